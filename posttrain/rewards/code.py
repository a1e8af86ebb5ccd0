"""The built-in `code` reward: the response's program runs against the record's test cases in the sandbox.

The ground truth is the test cases as a JSON string (verl's ``reward_model.ground_truth`` for APPS, TACO and
CodeContests-style data), in one of two forms:

- stdin/stdout: ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}``: each input is the program's stdin,
  each output the expected stdout (compared line by line, trailing whitespace ignored);
- call-based: the same plus ``"fn_name": "add"``: each input is the list of arguments (or a JSON text of it)
  and each output the expected return value (or a one-element list holding it); a LeetCode-style
  ``class Solution`` with that method works too.

The program is the last fenced code block of the response (```` ```python ````), else the whole response.
The score is the fraction of cases passed, or 1.0/0.0 with ``sandbox.code_reward.mode=all_or_nothing``. A
program that does not compile scores 0 after one run; a case over the time or memory limit fails. The counts
(cases, passes, compile errors, time and memory limits, sandbox errors) are kept in :data:`COUNTS` and reach the
step's metrics as ``reward/code/<name>`` (:mod:`posttrain.rewards.counts`).
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from typing import Any

from posttrain.config.errors import ConfigError
from posttrain.config.schema.sandbox import SandboxConfig
from posttrain.rewards import counts
from posttrain.sandbox.build import Sandbox, build_sandbox
from posttrain.sandbox.types import MEMORY_LIMIT, SANDBOX_ERROR, TIME_LIMIT, RunRequest, RunResult

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
COUNTS: Counter[str] = Counter()
_SYNTAX_ERRORS = ("SyntaxError", "IndentationError", "TabError")
_LOCK = threading.Lock()

CALL_HARNESS = """\
import json, sys
sys.path.insert(0, ".")
import solution
case = json.loads(sys.stdin.read())
fn = getattr(solution, case["fn_name"], None)
if fn is None and hasattr(solution, "Solution"):
    fn = getattr(solution.Solution(), case["fn_name"])
args = case["input"]
if isinstance(args, str):
    args = json.loads(args)
got = fn(*args) if isinstance(args, list) else fn(args)
got = json.loads(json.dumps(got))  # tuples -> lists, as the expected values are JSON
want = case["output"]
if isinstance(want, str):
    try:
        want = json.loads(want)
    except ValueError:
        pass
print("__PASSED__" if got == want or [got] == want else "__FAILED__")
"""


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


def _same_output(got: str, want: Any) -> bool:
    want = (
        want if isinstance(want, str) else "\n".join(map(str, want)) if isinstance(want, list) else str(want)
    )
    lines = lambda text: [line.rstrip() for line in text.strip().splitlines()]  # noqa: E731
    return lines(got) == lines(want)


def _requests(code: str, cases: dict[str, Any]) -> list[RunRequest]:
    fn_name = cases.get("fn_name")
    if not fn_name:
        return [RunRequest(code, stdin=_text(i)) for i in cases["inputs"]]
    files = {"solution.py": code.encode()}
    return [
        RunRequest(CALL_HARNESS, stdin=json.dumps({"fn_name": fn_name, "input": i, "output": o}), files=files)
        for i, o in zip(cases["inputs"], cases["outputs"], strict=True)
    ]


def _text(value: Any) -> str:
    return (
        value
        if isinstance(value, str)
        else "\n".join(map(str, value))
        if isinstance(value, list)
        else str(value)
    )


def _passed(result: RunResult, want: Any, call_based: bool) -> bool:
    if not result.ok:
        return False
    if call_based:
        return result.stdout.strip().endswith("__PASSED__")
    return _same_output(result.stdout, want)


def _compile_error(result: RunResult) -> bool:
    """The program did not compile: Python's last error line names a syntax error."""
    lines = result.stderr.strip().splitlines()
    return result.status == "error" and bool(lines) and lines[-1].startswith(_SYNTAX_ERRORS)


class CodeReward:
    """The code reward over one sandbox; callable as a reward function."""

    def __init__(self, sandbox: Sandbox, mode: str = "fraction", max_cases: int = 0) -> None:
        self.sandbox, self.mode, self.max_cases = sandbox, mode, max_cases

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
        requests = _requests(code, cases)
        wants = list(cases["outputs"])
        if self.max_cases:
            requests, wants = requests[: self.max_cases], wants[: self.max_cases]
        if not requests:
            return 0.0
        first = self.sandbox.run(requests[0])  # a program that does not compile is not run again
        if _compile_error(first):
            _count(samples=1, cases=1, compile_errors=1)
            return 0.0
        results = [first, *self.sandbox.run_many(requests[1:])]
        call_based = bool(cases.get("fn_name"))
        passed = sum(_passed(r, w, call_based) for r, w in zip(results, wants, strict=True))
        statuses = Counter(r.status for r in results)
        _count(
            samples=1,
            cases=len(results),
            passed=passed,
            time_limits=statuses[TIME_LIMIT],
            memory_limits=statuses[MEMORY_LIMIT],
            sandbox_errors=statuses[SANDBOX_ERROR],
        )
        if self.mode == "all_or_nothing":
            return 1.0 if passed == len(results) else 0.0
        return passed / len(results)


def _count(**kw: int) -> None:
    with _LOCK:
        COUNTS.update(kw)
    counts.add("code", {name: kw.get(name, 0) for name in counts.CODE_COUNTS})


_DEFAULT: CodeReward | None = None


def configure_code_reward(cfg: SandboxConfig) -> CodeReward:
    """Build the sandbox of the `sandbox` section for the built-in `code` reward (a ConfigError now, at start-up,
    when it cannot work here)."""
    global _DEFAULT
    _DEFAULT = CodeReward(build_sandbox(cfg), cfg.code_reward.mode, cfg.code_reward.max_cases)
    return _DEFAULT


#: The reward names that run code in the sandbox (``data_source_code``: data with code sources).
SANDBOX_REWARDS = ("code", "data_source_code")


def configure_reward_sandbox(reward_spec: str, cfg: SandboxConfig) -> None:
    """Build the `sandbox` section's sandbox when ``reward_spec`` runs code (a ConfigError now, at start-up, when
    it cannot work here); every command that scores with a reward (train, eval, SFT validation) calls it."""
    if reward_spec in SANDBOX_REWARDS:
        configure_code_reward(cfg)


def _configured() -> CodeReward:
    return _DEFAULT or configure_code_reward(SandboxConfig())


def code_reward(prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any]) -> float:
    """The `code` reward with the sandbox set by :func:`configure_code_reward` (the defaults if none was)."""
    return _configured()(prompt, response, ground_truth, extra)


# The runner scores several samples at once (posttrain.rewards.many); asked before the first call, so the
# sandbox is built once, not by each thread.
code_reward.samples_at_once = lambda: _configured().samples_at_once()  # type: ignore[attr-defined]
