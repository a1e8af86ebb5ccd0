"""The built-in `code` reward: the response's program runs against the record's test cases in the sandbox.

The ground truth is the test cases as a JSON string (verl's ``reward_model.ground_truth`` for APPS, TACO and
CodeContests-style data), in one of two forms:

- stdin/stdout: ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}``: each input is the program's stdin,
  each output the expected stdout (compared line by line, trailing whitespace ignored);
- call-based: the same plus ``"fn_name": "add"``: each input is the list of arguments (or a JSON text of it)
  and each output the expected return value, compared as APPS's checker does (:func:`expected_digests`); a
  LeetCode-style ``class Solution`` with that method works too.

The program is the last fenced code block of the response (```` ```python ````), else the whole response.
It runs under :mod:`posttrain.rewards.code_harness`: one sandbox run holds up to
``sandbox.code_reward.cases_per_run`` cases, each in a forked process of its own under the sandbox's limits,
and the expected outputs never enter the sandbox (the harness reports digests, compared here).
The score is the fraction of cases passed, or 1.0/0.0 with ``sandbox.code_reward.mode=all_or_nothing``. A
program that does not compile scores 0 after one run; a case over the time or memory limit fails. The counts
(cases, passes, compile errors, time and memory limits, sandbox errors) are kept in :data:`COUNTS` and reach the
step's metrics as ``reward/code/<name>`` (:mod:`posttrain.rewards.counts`).
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.config.errors import ConfigError
from posttrain.config.schema.sandbox import CodeRewardConfig
from posttrain.rewards import code_harness, counts
from posttrain.rewards.code_harness import text_digest, value_digest
from posttrain.sandbox.build import Sandbox
from posttrain.sandbox.process import run_status
from posttrain.sandbox.types import (
    FINISHED,
    MEMORY_LIMIT,
    OUTPUT_TRUNCATED,
    SANDBOX_ERROR,
    TIME_LIMIT,
    Limits,
    RunRequest,
    RunResult,
)

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
COUNTS: Counter[str] = Counter()
_LOCK = threading.Lock()
HARNESS_SOURCE = Path(code_harness.__file__).read_text()
# The harness's report on one case, at most (its stderr's tail and a digest): the report of a run must fit in the
# sandbox's output cap, so a small ``sandbox.max_output_bytes`` means fewer cases a run.
REPORT_BYTES_PER_CASE = 1024


def extract_code(response: str) -> str:
    """The last fenced code block (a python one preferred), else the whole response."""
    blocks = _FENCE.findall(response)
    if not blocks:
        return response.strip()
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [code for _, code in blocks])[-1].strip()


def parse_cases(ground_truth: str | dict | None) -> dict[str, Any]:
    """The test cases of a record; a ConfigError naming the problem when they are malformed."""
    if ground_truth is None:
        raise ConfigError(
            "the code reward needs test cases in the record's ground truth; the record has none"
        )
    cases = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not isinstance(cases, dict) or not isinstance(cases.get("inputs"), list):
        raise ConfigError(
            'the code reward\'s ground truth must be JSON like {"inputs": [...], "outputs": [...]} '
            f'(optionally with "fn_name"); got {str(ground_truth)[:120]!r}'
        )
    if len(cases["inputs"]) != len(cases.get("outputs") or []):
        raise ConfigError(
            f"the code reward's test cases have {len(cases['inputs'])} inputs but "
            f"{len(cases.get('outputs') or [])} outputs; give one output per input"
        )
    return cases


def _text(value: Any) -> str:
    return (
        value
        if isinstance(value, str)
        else "\n".join(map(str, value))
        if isinstance(value, list)
        else str(value)
    )


def expected_digests(cases: dict[str, Any]) -> list[frozenset[str]]:
    """For each case, the digests of the outputs that pass it (the harness reports the program's digest).

    Call-based cases follow APPS's checker (``testing_util.py``, which TACO's reuses): the returned value is
    compared with ``==`` to the expected value as the JSON holds it (a string stays a string: ``"123"`` is not
    passed by ``123``), a tuple counts as a list, and when the expected value is a non-empty list, its first
    element passes too (APPS wraps many expected values in a list)."""
    if not cases.get("fn_name"):
        return [frozenset({text_digest(_text(want))}) for want in cases["outputs"]]
    out = []
    for want in cases["outputs"]:
        ok = {value_digest(want)}
        if isinstance(want, list) and want:
            ok.add(value_digest(want[0]))
        out.append(frozenset(ok))
    return out


def harness_request(
    code: str,
    cases: dict[str, Any],
    inputs: list[Any],
    limits: Limits,
    nonce: str,
    own_pid_namespace: bool = False,
) -> RunRequest:
    """One sandbox run of the harness over ``inputs`` (some of the cases), each under ``limits``: the program,
    the settings, each stdin/stdout case's input as a file of its own, and ``nonce``, which the harness's report
    must carry. ``own_pid_namespace``: the backend runs it in a PID namespace of its own, where the harness may
    kill whatever a case left behind."""
    call_based = bool(cases.get("fn_name"))
    spec = {
        "fn_name": cases.get("fn_name"),
        "inputs": inputs if call_based else [],
        "count": len(inputs),
        "time_limit_s": limits.time_limit_s,
        "cpu_seconds": limits.cpu_seconds,
        "max_output_bytes": limits.max_output_bytes,
        "own_pid_namespace": own_pid_namespace,
    }
    files = {
        code_harness.SOLUTION_FILE: code.encode(),
        code_harness.CASES_FILE: json.dumps(spec).encode(),
        code_harness.NONCE_FILE: nonce.encode(),
    }
    if not call_based:
        files |= {code_harness.input_file(i): _text(value).encode() for i, value in enumerate(inputs)}
    return RunRequest(HARNESS_SOURCE, files=files, executions=len(inputs))


@dataclass(frozen=True)
class HarnessRun:
    """A harness run read back: a compile error, or per case its status and output digest."""

    compile_error: str | None
    statuses: list[str]
    digests: list[str]


def read_harness(result: RunResult, cases: int, nonce: str) -> HarnessRun:
    """The harness's report: a case each, up to the one that reached its time limit (the harness stops there).

    Trusted only from a run that finished and only with ``nonce``, holding no more cases than the run had and
    fewer only after a time limit. Otherwise every case takes the run's status where that is a limit (time,
    memory, output), else ``sandbox_error``: nothing the program does makes the reward raise or pass."""
    prefix = code_harness.REPORT_MARKER + nonce + " "
    tail = result.stdout.rstrip("\n").rpartition("\n")[2]
    if result.status == FINISHED and nonce and tail.startswith(prefix):
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
            run = _harness_run(json.loads(tail[len(prefix) :]), cases)
            if run is not None:
                return run
    status = result.status if result.status in (TIME_LIMIT, MEMORY_LIMIT, OUTPUT_TRUNCATED) else SANDBOX_ERROR
    return HarnessRun(None, [status] * cases, [""] * cases)


def _harness_run(report: dict[str, Any], cases: int) -> HarnessRun | None:
    """The report read back; None when it cannot be the harness's (a count that does not fit)."""
    if report["compile_error"]:
        return HarnessRun(str(report["compile_error"]), [], [])
    reported = report["cases"]
    if not isinstance(reported, list) or not 0 < len(reported) <= cases:
        return None
    statuses = [
        run_status(int(c["returncode"]), bool(c["timed_out"]), bool(c["truncated"]), c["stderr"].encode(), 0)[
            0
        ]
        for c in reported
    ]
    if len(reported) < cases and statuses[-1] != TIME_LIMIT:
        return None  # the harness stops early only after a case that reached its time limit
    return HarnessRun(None, statuses, [str(c["digest"]) for c in reported])


class CodeReward:
    """The code reward over one sandbox; callable as a reward function."""

    def __init__(
        self, sandbox: Sandbox, mode: str = "fraction", max_cases: int = 0, cases_per_run: int = 16
    ) -> None:
        self.sandbox, self.mode, self.max_cases = sandbox, mode, max_cases
        self.cases_per_run = cases_per_run

    def samples_at_once(self) -> int:
        """Samples the reward runner may score at once (thread-safe: the sandbox bounds the programs running
        together to ``max_concurrent``). As many as the sandbox's slots: twice or four times that many were no
        faster (docs/sandbox.md), and each answer's timeout grows with the number."""
        return self.sandbox.max_concurrent

    def __call__(self, prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any]) -> float:
        cases = parse_cases(ground_truth)
        code = extract_code(response)
        if not code:
            _count(no_code=1)
            return 0.0
        inputs, wants = list(cases["inputs"]), expected_digests(cases)
        if self.max_cases:
            inputs, wants = inputs[: self.max_cases], wants[: self.max_cases]
        if not inputs:
            return 0.0
        run = self._run(code, cases, inputs)
        if run.compile_error:
            _count(samples=1, cases=1, compile_errors=1)
            return 0.0
        statuses, digests = run.statuses, run.digests
        passed = sum(s == FINISHED and d in ok for s, d, ok in zip(statuses, digests, wants, strict=True))
        counted = Counter(statuses)
        _count(
            samples=1,
            cases=len(statuses),
            passed=passed,
            time_limits=counted[TIME_LIMIT],
            memory_limits=counted[MEMORY_LIMIT],
            sandbox_errors=counted[SANDBOX_ERROR],
        )
        if self.mode == "all_or_nothing":
            return 1.0 if passed == len(statuses) else 0.0
        return passed / len(statuses)

    def _run(self, code: str, cases: dict[str, Any], inputs: list[Any]) -> HarnessRun:
        """The cases in runs of ``cases_per_run``: the first alone (a program that does not compile is not run
        again), the others in parallel. A run stops after a case that reached its time limit, and the cases it
        left get a run each, in parallel: a program that loops takes no longer than with a run per case."""
        size = max(1, min(self.cases_per_run, self.sandbox.limits.max_output_bytes // REPORT_BYTES_PER_CASE))
        chunks = [inputs[i : i + size] for i in range(0, len(inputs), size)]
        first = self._harness(code, cases, [chunks[0]])[0]
        if first.compile_error:
            return first
        runs = [first, *self._harness(code, cases, chunks[1:])]
        statuses: list[str] = []
        digests: list[str] = []
        left: list[int] = []  # cases a run did not reach, after one that reached its time limit
        for run, chunk in zip(runs, chunks, strict=True):
            reached = len(run.statuses)
            left += range(len(statuses) + reached, len(statuses) + len(chunk))
            statuses += [*run.statuses, *[""] * (len(chunk) - reached)]
            digests += [*run.digests, *[""] * (len(chunk) - reached)]
        singles = self._harness(code, cases, [[inputs[i]] for i in left])
        for i, single in zip(left, singles, strict=True):
            statuses[i], digests[i] = single.statuses[0], single.digests[0]
        return HarnessRun(None, statuses, digests)

    def _harness(self, code: str, cases: dict[str, Any], chunks: list[list[Any]]) -> list[HarnessRun]:
        """One harness run per chunk of inputs, in parallel, each with a nonce of its own."""
        backend = self.sandbox.backend
        nonces = [secrets.token_hex(16) for _ in chunks]
        requests = [
            harness_request(code, cases, chunk, backend.limits, nonce, backend.own_pid_namespace)
            for chunk, nonce in zip(chunks, nonces, strict=True)
        ]
        results = self.sandbox.run_many(requests)
        return [read_harness(r, len(c), n) for r, c, n in zip(results, chunks, nonces, strict=True)]


def _count(**kw: int) -> None:
    with _LOCK:
        COUNTS.update(kw)
    counts.add("code", {name: kw.get(name, 0) for name in counts.CODE_COUNTS})


#: The reward names that run code in the sandbox (``data_source_code``: data with code sources).
SANDBOX_REWARDS = ("code", "data_source_code")


def code_reward_of(cfg: CodeRewardConfig, sandbox: Sandbox) -> CodeReward:
    """The `code` reward of the `sandbox.code_reward` section, over the run's sandbox."""
    return CodeReward(sandbox, cfg.mode, cfg.max_cases, cfg.cases_per_run)
