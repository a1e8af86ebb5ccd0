"""Run one command under rlimits with a wall-clock limit and capped output, and kill everything it started.

The rlimits are set by util-linux's prlimit just before the program starts (they hold for every process
of the program). The command runs in a session of its own; at the end (finished, timed out or over the output
cap) its whole process group gets SIGKILL. Under bubblewrap the program's processes also sit in their own PID
namespace, which the kernel empties when the sandbox's first process dies.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from posttrain.sandbox.types import (
    ERROR,
    FINISHED,
    MEMORY_LIMIT,
    OUTPUT_TRUNCATED,
    SANDBOX_ERROR,
    TIME_LIMIT,
    Limits,
    RunResult,
)

_MIB = 1024 * 1024
_READ_CHUNK = 65536
_MEMORY_SIGNS = ("MemoryError", "Cannot allocate memory", "bad_alloc", "out of memory", "xmalloc: cannot")
_CPU_KILLED = {signal.SIGXCPU}


PRLIMIT = "/usr/bin/prlimit"


class _SpawnGuard:
    """Keeps forks of this process out of the moments another thread is starting a program.

    ``subprocess.Popen`` waits until its child has exec'd, on a pipe only that child should hold. A fork made by
    another thread meanwhile (a reward worker: multiprocessing's fork, which never execs) copies the pipe and
    keeps it open, and the Popen waits as long as the worker lives: the python tool hung beside the code reward's
    workers. So a fork waits while a program starts here, and a program waits while a fork happens."""

    def __init__(self) -> None:
        self.lock = (
            threading.RLock()
        )  # re-entrant: a Popen with a preexec_fn runs the fork hooks in its thread
        os.register_at_fork(
            before=lambda: self.lock.acquire(),
            after_in_parent=lambda: self.lock.release(),
            after_in_child=self._fresh,
        )

    def _fresh(self) -> None:
        self.lock = threading.RLock()


_SPAWN_GUARD = _SpawnGuard()
_CANCEL_POLL_S = 0.05  # how soon a cancelled run is killed
CANCELLED_MESSAGE = "cancelled: the client went away"


def rlimit_argv(limits: Limits) -> list[str]:
    """util-linux's prlimit setting the rlimits, then exec'ing what follows (soft = hard, except CPU: SIGXCPU
    one second before SIGKILL). A launcher binary rather than a pre-exec hook in Python: a hook forces a full
    fork of the (large) trainer process, which cost about 70 ms per run."""
    memory, size = limits.memory_limit_mb * _MIB, limits.max_file_size_mb * _MIB
    cpu = limits.cpu_seconds
    return [
        PRLIMIT,
        f"--as={memory}",
        f"--cpu={cpu}:{cpu + 1}",
        f"--nproc={limits.max_processes}",
        f"--fsize={size}",
        "--core=0",
        "--",
    ]


def _set_limits(limits: Limits) -> None:
    """In the child, before exec: the same rlimits (where no prlimit binary exists; unsafe mode only)."""
    memory = limits.memory_limit_mb * _MIB
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu = limits.cpu_seconds
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
    size = limits.max_file_size_mb * _MIB
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


@dataclass
class _Capture:
    """One output pipe read to its cap; what comes beyond the cap sets ``over`` and is dropped."""

    cap: int
    data: bytearray
    over: bool = False
    last: float = 0.0  # time.monotonic() of the last read

    def drain(self, pipe, stop: threading.Event) -> None:  # noqa: ANN001 (a binary file object)
        try:
            while chunk := pipe.read1(_READ_CHUNK):
                self.last = time.monotonic()
                room = self.cap - len(self.data)
                self.data += chunk[:room]
                if len(chunk) > room:
                    self.over = True
                    stop.set()
                    return
        except (OSError, ValueError):
            return  # the pipe was closed under us after the kill


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_command(
    argv: list[str],
    limits: Limits,
    *,
    stdin: bytes = b"",
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    signal_offset: int = 0,
    preexec_limits: bool = False,
    pass_fds: tuple[int, ...] = (),
    progress_limit_s: float | None = None,
    cancel: threading.Event | None = None,
) -> RunResult:
    """Run ``argv`` under ``limits``; never raises for what the program does.

    ``signal_offset``: a launcher that reports a child killed by signal N as exit code offset + N (bubblewrap:
    128) lets the status tell a CPU-limit kill from an ordinary exit. The rlimits are in ``argv``
    (:func:`rlimit_argv`), or set before exec with ``preexec_limits``. ``pass_fds``: file descriptors the
    command inherits (bwrap's ``--info-fd``). ``progress_limit_s``: the run also ends (a time limit) once its
    stdout has been silent that long. ``cancel``: when set (e.g. the HTTP client went away), the run ends as
    at its time limit, with status sandbox_error."""
    start = time.monotonic()
    with _SPAWN_GUARD.lock:  # no fork copies Popen's exec-status pipe while the program starts
        proc = _popen(argv, env, cwd, limits, preexec_limits, pass_fds)
    stop = threading.Event()
    out = _Capture(limits.max_output_bytes, bytearray(), last=start)
    err = _Capture(limits.max_output_bytes, bytearray())
    threads = [
        threading.Thread(target=out.drain, args=(proc.stdout, stop), daemon=True),
        threading.Thread(target=err.drain, args=(proc.stderr, stop), daemon=True),
        threading.Thread(target=lambda: (proc.wait(), stop.set()), daemon=True),
        threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True),
    ]
    for t in threads:
        t.start()
    ended = _wait(stop, start + limits.time_limit_s, out, progress_limit_s, cancel)
    timed_out = ended == "timeout"
    _kill_group(proc)  # whatever the outcome: nothing the program started outlives the call
    proc.wait()
    for t in threads[:2]:
        t.join(timeout=1.0)
    for pipe in (proc.stdout, proc.stderr):
        pipe.close()
    duration = time.monotonic() - start
    status, code = run_status(
        proc.returncode, timed_out, out.over or err.over, bytes(err.data), signal_offset
    )
    text = lambda b: bytes(b).decode("utf-8", errors="replace")  # noqa: E731
    if ended == "cancelled":
        return RunResult(SANDBOX_ERROR, None, text(out.data), CANCELLED_MESSAGE, duration)
    return RunResult(status, code, text(out.data), text(err.data), duration)


def _popen(
    argv: list[str],
    env: dict[str, str] | None,
    cwd: str | None,
    limits: Limits,
    preexec_limits: bool,
    pass_fds: tuple[int, ...],
) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env if env is not None else {},
        cwd=cwd,
        start_new_session=True,
        preexec_fn=(lambda: _set_limits(limits)) if preexec_limits else None,
        pass_fds=pass_fds,
    )


def _wait(
    stop: threading.Event,
    deadline: float,
    out: _Capture,
    progress_limit_s: float | None,
    cancel: threading.Event | None,
) -> str:
    """How the run ended: "done" (exited, or over the output cap), "timeout" (``deadline`` passed, or stdout
    silent for ``progress_limit_s``) or "cancelled"."""
    while cancel is None or not cancel.is_set():
        until = deadline if progress_limit_s is None else min(deadline, out.last + progress_limit_s)
        left = until - time.monotonic()
        if left <= 0:
            return "done" if stop.is_set() else "timeout"
        if stop.wait(left if cancel is None else min(left, _CANCEL_POLL_S)):  # at once when the program ends
            return "done"
    return "cancelled"


def _feed(pipe, data: bytes) -> None:  # noqa: ANN001
    try:
        if data:
            pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError, ValueError):
        pass  # the program exited without reading its stdin


def run_status(
    returncode: int, timed_out: bool, truncated: bool, stderr: bytes, signal_offset: int
) -> tuple[str, int | None]:
    """A run's status and exit code from how it ended (also the code reward's, for each case its harness ran)."""
    if timed_out:
        return TIME_LIMIT, None
    if truncated:
        return OUTPUT_TRUNCATED, None
    signum = -returncode if returncode < 0 else 0
    if signal_offset and returncode > signal_offset:
        signum = returncode - signal_offset
    if signum in _CPU_KILLED:
        return TIME_LIMIT, returncode
    if returncode == 0:
        return FINISHED, 0
    if memory_signs_in(stderr[-4096:].decode("utf-8", errors="replace")):
        return MEMORY_LIMIT, returncode
    return ERROR, returncode


def memory_signs_in(stderr: str) -> bool:
    """Whether a program's error output says an allocation failed (what RLIMIT_AS makes of too much memory)."""
    return any(sign in stderr[-4096:] for sign in _MEMORY_SIGNS)
