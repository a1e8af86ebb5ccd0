"""The start-up check of the sandbox the code reward runs programs in: one trivial program through the code
reward's own harness (posttrain.rewards.code_harness), at the configured memory limit.

A plain ``print(6 * 7)`` run (the probe before this one) said yes where the harness could not run:
at ``sandbox.memory_limit_mb=16`` the harness's interpreter fails with MemoryError, and the code reward scored
every correct program 0 (``reward/code/memory_limits`` 24 of 24) while explain's probe passed. Here a memory
limit the harness cannot run under is a ConfigError naming ``sandbox.memory_limit_mb`` and the smallest value
that works on this machine (found by running the harness at larger limits). The schema refuses less than 32 MiB
(sandbox.memory_limit_mb's minimum); the probe catches an interpreter that needs more than that.

Time is judged apart, so the verdict does not depend on the machine's load: the probe runs with a wall and CPU
limit of at least ``PROBE_TIME_S`` and reports how long the trivial case took; explain shows that beside
``sandbox.time_limit_s`` (a limit below it fails even trivial programs at the present load), and nothing is
refused for time.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass

from posttrain.config.errors import ConfigError
from posttrain.config.schema.sandbox import SandboxConfig
from posttrain.rewards.code import expected_digests, harness_request, read_harness
from posttrain.sandbox.build import build_sandbox
from posttrain.sandbox.types import FINISHED, MEMORY_LIMIT

PROBE_TIME_S = 10.0  # the probe's wall and CPU limit at least: a loaded machine still starts Python in it
PROBE_CODE = "print(6 * 7)"
_CASES = {"inputs": [""], "outputs": ["42\n"]}
_LARGEST_MB = 4096  # where the search for a working memory limit gives up
_STEP_MB = 8  # the working memory limit is named to this step
_RUNS = 3  # runs in a row a memory limit must pass to be named
# What a harness short of address space says when it is not a MemoryError (status memory_limit)
_OUT_OF_MEMORY = ("MemoryError", "failed to map segment", "Cannot allocate memory")


@dataclass(frozen=True)
class HarnessProbe:
    """One trivial case through the harness: did it pass, its status, how long the run took, the error tail."""

    passed: bool
    status: str
    duration_s: float
    detail: str


def run_harness_probe(cfg: SandboxConfig, memory_limit_mb: int | None = None) -> HarnessProbe:
    """``PROBE_CODE`` as one stdin/stdout case of the harness, under ``cfg``'s limits (``memory_limit_mb``
    instead of its own when given) with time limits of at least ``PROBE_TIME_S``."""
    probe_cfg = dataclasses.replace(
        cfg,
        time_limit_s=max(cfg.time_limit_s, PROBE_TIME_S),
        cpu_time_limit_s=max(cfg.cpu_time_limit_s or 0.0, PROBE_TIME_S),
        memory_limit_mb=memory_limit_mb or cfg.memory_limit_mb,
    )
    box = build_sandbox(probe_cfg)
    try:
        backend, nonce = box.backend, secrets.token_hex(16)
        request = harness_request(
            PROBE_CODE, _CASES, _CASES["inputs"], backend.limits, nonce, backend.own_pid_namespace
        )
        result = box.run(request)
    finally:
        box.close()
    run = read_harness(result, 1, nonce)
    if run.compile_error:  # cannot be the program's: the harness itself did not run
        return HarnessProbe(False, "compile_error", result.duration_s, run.compile_error[-300:])
    passed = run.statuses == [FINISHED] and run.digests[0] in expected_digests(_CASES)[0]
    detail = (result.stderr or result.stdout).strip()[-300:]
    return HarnessProbe(passed, run.statuses[0], result.duration_s, detail)


def smallest_memory_that_works(cfg: SandboxConfig) -> int | None:
    """The smallest ``sandbox.memory_limit_mb``, a multiple of ``_STEP_MB`` above the configured one, under
    which the harness runs ``_RUNS`` times in a row, or None when not even ``_LARGEST_MB`` does. Near the edge
    a run fails now and then (a shared library that cannot be mapped), so the edge found by halving is only
    where the search for a value that always works starts."""
    low, high = cfg.memory_limit_mb, cfg.memory_limit_mb * 2
    while not run_harness_probe(cfg, high).passed:  # low fails, find a high that works
        if high >= _LARGEST_MB:
            return None
        low, high = high, min(high * 2, _LARGEST_MB)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if run_harness_probe(cfg, middle).passed else (middle, high)
    works = -(-high // _STEP_MB) * _STEP_MB
    while not all(run_harness_probe(cfg, works).passed for _ in range(_RUNS)):
        if works >= _LARGEST_MB:
            return None
        works += _STEP_MB
    return works


def check_code_sandbox(cfg: SandboxConfig) -> HarnessProbe:
    """The harness probe, passed; a ConfigError naming the key and a value that works otherwise."""
    probe = run_harness_probe(cfg)
    if probe.passed:
        return probe
    where = build_sandbox(cfg).describe()
    if probe.status == MEMORY_LIMIT or any(sign in probe.detail for sign in _OUT_OF_MEMORY):
        works = smallest_memory_that_works(cfg)
        fix = (
            f"set sandbox.memory_limit_mb={works} or more (the smallest multiple of {_STEP_MB} that runs it "
            f"{_RUNS} times in a row on this machine; real programs need more)"
            if works
            else f"not even sandbox.memory_limit_mb={_LARGEST_MB} runs it: check the sandbox (docs/sandbox.md)"
        )
        raise ConfigError(
            f"sandbox.memory_limit_mb={cfg.memory_limit_mb} is too small for the code reward's harness to start "
            f"Python (a trivial program ended with status {probe.status}, {probe.detail!r}); every program would "
            f"score 0; {fix}"
        )
    raise ConfigError(
        f"the sandbox ({where}) cannot run the code reward's harness on a trivial program: status "
        f"{probe.status}, {probe.detail!r}; check the sandbox.* keys (docs/sandbox.md)"
    )


def harness_probe_line(cfg: SandboxConfig) -> str:
    """One line for `posttrain explain`: the sandbox, its limits, and the checked harness probe."""
    probe = check_code_sandbox(cfg)
    line = (
        f"sandbox: {build_sandbox(cfg).describe()}; probe: {PROBE_CODE} -> 42 in {probe.duration_s:.2f} s "
        f"(the code reward's harness at sandbox.memory_limit_mb={cfg.memory_limit_mb}; time judged apart, with "
        f"a {PROBE_TIME_S:g} s limit)"
    )
    if probe.duration_s > cfg.time_limit_s:
        line += (
            f"; warning: that is more than sandbox.time_limit_s={cfg.time_limit_s:g} s, so at this load even "
            "a trivial program would reach the time limit"
        )
    return line
