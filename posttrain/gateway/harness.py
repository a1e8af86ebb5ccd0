"""Running a harness: the user's agent loop, once per trajectory, pointed at its session of the gateway.

Two forms (``harness.path`` / ``harness.command``): a Python callable ``fn(row, base_url, api_key)``, sync (run on
a worker thread) or async (awaited); or an external command with ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` in its
environment and the row as JSON on stdin, its result the last line of its stdout. Either returns a reward (a
number), ``{"reward": number | None, "metrics": {name: number}}``, or None (the reward function scores the final
messages). Whatever goes wrong is a :class:`HarnessFailure` of one kind (``FAILURE_KINDS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
import numbers
import os
import shlex
import shutil
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.agents.trajectory import add_step_metrics
from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.config.schema.harness import HarnessConfig, harness_enabled
from posttrain.utils.user_code import function_of, import_file

# raised: the callable raised; exit: the command exited non-zero; bad_output: a result of the wrong form;
# timeout: past harness.timeout_s; no_calls: no model call made; prefix_break: a break under on_prefix_break=fail.
FAILURE_KINDS = ("raised", "exit", "bad_output", "timeout", "no_calls", "prefix_break")
FAILURE_METRIC = "gateway/harness_failures/"  # + kind
RESULT_KEYS = ("reward", "metrics")
STDERR_TAIL = 2000  # characters of a failed command's stderr quoted in its failure


class HarnessFailure(ConfigError):
    """A harness failed on one trajectory (``kind`` one of ``FAILURE_KINDS``); the message names the row. The
    user's code: the command line shows it as one message."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    def __reduce__(self):  # pickled whole (a rank's failure crossing processes), kind included
        return type(self), (self.kind, str(self))


@dataclass
class HarnessResult:
    """What a harness returned: its reward (None: the reward function's score stands) and its metrics."""

    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CallableHarness:
    fn: Callable[..., Any]
    name: str


@dataclass(frozen=True)
class CommandHarness:
    argv: tuple[str, ...]
    name: str


Harness = CallableHarness | CommandHarness


def load_harness(cfg: HarnessConfig) -> Harness:
    """The configured harness, imported (a callable) or its program found (a command); ConfigError naming the
    key, the value and the fix otherwise."""
    if cfg.path:
        where = f"harness.path={cfg.path!r}"
        file, sep, name = cfg.path.rpartition(":")
        if not sep or not file or not name:
            raise ConfigError(f"{where}: expected 'path/to/file.py:function' (a file and a function name)")
        return CallableHarness(function_of(import_file(Path(file), where), name, where), cfg.path)
    where = f"harness.command={cfg.command!r}"
    try:
        argv = tuple(shlex.split(cfg.command))
    except ValueError as exc:
        raise ConfigError(f"{where}: cannot split it into arguments ({exc}); fix its quoting") from exc
    if not argv:
        raise ConfigError(f"{where}: no program named; give the program and its arguments")
    if shutil.which(argv[0]) is None:
        raise ConfigError(
            f"{where}: program {argv[0]!r} not found (not an executable file, nor on PATH); give its path"
        )
    return CommandHarness(argv, cfg.command)


def check_harness(cfg: PostTrainConfig) -> None:
    """What a run with a harness checks before any model loads: the harness loads, and no setting it cannot
    serve is on (the rules of rollout.multi_turn that concern any multi-turn trajectory)."""
    h = cfg.harness
    if not harness_enabled(h):
        return
    key = f"harness.path={h.path!r}" if h.path else f"harness.command={h.command!r}"
    load_harness(h)
    if cfg.algorithm.adv_estimator == "remax":
        raise ConfigError(
            f"algorithm.adv_estimator=remax with {key}: ReMax's baseline is one greedy single-turn response "
            "per prompt, which a harness's trajectory has no counterpart for; use grpo (or rloo, gae)"
        )
    if cfg.async_training.partial_rollout:
        raise ConfigError(
            f"async_training.partial_rollout=true with {key}: a partial rollout is continued as plain tokens, "
            "not through the harness; set async_training.partial_rollout=false"
        )
    limit, per_turn = cfg.data.max_response_length, cfg.rollout.multi_turn.max_tokens_per_turn
    if per_turn > limit:
        raise ConfigError(
            f"rollout.multi_turn.max_tokens_per_turn={per_turn} is more than data.max_response_length={limit}, "
            f"the budget of a whole harness trajectory; set it <= {limit} (or 0)"
        )


def parse_result(value: Any, where: str) -> HarnessResult:
    """A harness's return value as a :class:`HarnessResult`; HarnessFailure "bad_output" naming ``where`` for
    anything but a finite number, None, or a dict with only ``reward`` (number or None) and ``metrics``."""
    if value is None:
        return HarnessResult()
    if isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in RESULT_KEYS)
        if unknown:
            raise HarnessFailure(
                "bad_output",
                f"{where} returned a dict with the keys {unknown}: only {list(RESULT_KEYS)} are read",
            )
        result = HarnessResult(_reward(value.get("reward"), where))
        metrics = value.get("metrics") or {}
        if not isinstance(metrics, Mapping):
            raise HarnessFailure(
                "bad_output", f"{where} returned metrics={metrics!r}: metrics is a dict of name -> number"
            )
        try:
            add_step_metrics(result.metrics, metrics, where)
        except ConfigError as exc:
            raise HarnessFailure("bad_output", str(exc)) from exc
        return result
    return HarnessResult(_reward(value, where))


def _reward(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise HarnessFailure(
            "bad_output",
            f"{where} returned the reward {value!r}: a reward is a finite number (or None to let the reward "
            "function score the final messages)",
        )
    return float(value)


async def run_harness(
    harness: Harness,
    row: dict[str, Any],
    base_url: str,
    api_key: str,
    timeout_s: float,
    where: str = "",
) -> HarnessResult:
    """Run ``harness`` on one row against its session (``base_url``, ``api_key``) for at most ``timeout_s``
    seconds; ``where`` names the row in failures."""
    where = f"harness {harness.name!r}{' on ' + where if where else ''}"
    if isinstance(harness, CommandHarness):
        return await _run_command(harness, row, base_url, api_key, timeout_s, where)
    try:
        if inspect.iscoroutinefunction(harness.fn):
            with _signal_handlers_kept():  # it runs on this (the main) thread, where signal.signal works
                value = await asyncio.wait_for(harness.fn(dict(row), base_url, api_key), timeout_s)
        else:
            value = await asyncio.wait_for(_in_thread(harness.fn, dict(row), base_url, api_key), timeout_s)
            if inspect.isawaitable(value):  # a sync function that returned a coroutine
                value = await asyncio.wait_for(value, timeout_s)
    except asyncio.TimeoutError as exc:
        raise HarnessFailure("timeout", f"{where} took more than harness.timeout_s={timeout_s}") from exc
    except Exception as exc:
        raise HarnessFailure("raised", f"{where} raised {exc!r}") from exc
    return parse_result(value, where)


@contextlib.contextmanager
def _signal_handlers_kept():
    """Puts back the run's SIGINT and SIGTERM handlers after a harness call. Agent libraries may install their own
    (a verifiers environment does, in its constructor: teardown, then exit), which would replace posttrain's
    (stop the run, saying what it left) and, under pytest-xdist, a worker's; only the main thread can set them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            if signal.getsignal(sig) is not handler and handler is not None:
                signal.signal(sig, handler)


def _in_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """``fn(*args)`` on a daemon thread of its own, as a future of the running loop. A thread per call: one that
    outlives its timeout (a thread cannot be killed) holds no pool slot another trajectory waits for, and does
    not keep the process alive; its session refuses its calls once closed."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # timed out meanwhile
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def target() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as exc:  # handed to the awaiting trajectory, which names it
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=target, daemon=True, name="harness").start()
    return future


async def _run_command(
    harness: CommandHarness, row: dict[str, Any], base_url: str, api_key: str, timeout_s: float, where: str
) -> HarnessResult:
    """The command in a process group of its own (a timeout kills the group: its children too)."""
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}
    proc = await asyncio.create_subprocess_exec(
        *harness.argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    stdin = json.dumps(row, default=str).encode()
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout_s)
    except asyncio.TimeoutError as exc:
        _kill_group(proc.pid)
        await proc.wait()
        raise HarnessFailure("timeout", f"{where} took more than harness.timeout_s={timeout_s}") from exc
    finally:
        _kill_group(proc.pid)  # what it left running in its group; also when cancelled (another one failed)
    if proc.returncode != 0:
        tail = err.decode(errors="replace")[-STDERR_TAIL:]
        raise HarnessFailure("exit", f"{where} exited with status {proc.returncode}; its stderr ends: {tail}")
    lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        raise HarnessFailure(
            "bad_output",
            f"{where} printed nothing: its last stdout line must be its result as JSON (or null)",
        )
    try:
        value = json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        raise HarnessFailure(
            "bad_output", f"{where}: its last stdout line {lines[-1][:200]!r} is not JSON ({exc})"
        ) from exc
    return parse_result(value, where)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pid, signal.SIGKILL)
