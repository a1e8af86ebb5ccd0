"""The code reward's test harness: one sandbox run holds many test cases, each in a process of its own.

This file is two things. The host imports its comparison helpers (:func:`text_digest`, :func:`value_digest`)
to fingerprint the expected outputs. And its source is the program the sandbox runs (stdlib only, no posttrain
import). Inside, it reads ``cases.json`` (the settings, and call-based cases' arguments) and ``solution.py``,
opens and unlinks each stdin/stdout case's input file (``case-<i>.in``), compiles the solution once, and then
forks one child per case. Each child gets its case's input as its file descriptor 0 and pipes as 1 and 2, with
the case's own CPU-time limit; the harness keeps the case's wall-clock limit and output cap, and at the end
kills the child's process group (and, in a PID namespace of the sandbox's own, every other process the case
left). A fork costs about 2 ms where a fresh sandboxed interpreter costs tens, so
a sample's cases cost one sandbox start instead of one each (docs/sandbox.md has the figures).

After a case that reached its time limit the harness stops; the host runs the cases it left one per run, in
parallel, so a program that loops on every case takes no longer than with a run per case.

Only the harness can report. It is not dumpable (no other process of its user id may open its descriptors
through /proc, or trace it), each case's child closes every descriptor but its own pipes before the program runs,
and the report carries a nonce the host put in a file the harness unlinks at its start and keeps open (never in
its memory while a case runs): a case cannot forge the report, and the host trusts none without the nonce. The
harness writes a newline to its stdout as each case begins, so the host can stop a run whose harness was
stopped (SIGSTOP) one execution's time limit after its last sign of life (:class:`RunRequest.executions`).

What the harness never sees is the expected output. It reports, for each case, the exit status, whether the
wall-clock limit or the output cap ended it, the tail of stderr and a SHA-256 digest of the case's normalised
output (stdin/stdout cases) or return value (call-based cases). The host compares digests. A program that
searches its process or its directory for the answers finds none.

A child runs the solution as ``python main.py`` would (stdin/stdout cases: as ``__main__`` with
``sys.argv == ["main.py"]``; an uncaught exception prints its traceback and exits 1; ``SystemExit`` gives its
code; atexit handlers and non-daemon threads run before the exit) or imports it as the module ``solution`` and
calls the function (call-based cases), as one run per case did before.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import json
import os
import resource
import selectors
import signal
import sys
import time
import traceback
import types

CASES_FILE = "cases.json"
SOLUTION_FILE = "solution.py"
NONCE_FILE = "nonce"
_PR_SET_DUMPABLE = 4
REPORT_MARKER = "__posttrain_code_harness_report__ "
STDERR_TAIL = 128  # characters: what the host needs to tell a memory error from another error (the last line)


def canonical_text(text: str) -> str:
    """Output as compared: surrounding blank lines and each line's trailing whitespace ignored."""
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _plain(value):
    """A JSON value in the form where Python's ``==`` and text equality agree (1 == 1.0 == True)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def text_digest(text: str) -> str:
    return hashlib.sha256(canonical_text(text).encode("utf-8", "replace")).hexdigest()


def value_digest(value) -> str:
    """The digest of a value as JSON sees it (tuples are lists, keys are strings)."""
    plain = _plain(json.loads(json.dumps(value)))
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()


def _python_exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _finish_like_python() -> None:
    """What an interpreter does after the main module: join non-daemon threads, run atexit, flush."""
    threading = sys.modules.get("threading")  # only a program that started threads has imported it
    if threading is not None:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def _run_solution(code, cases: dict, index: int, result_fd: int) -> int:
    """In the child: the solution on one case; the exit code."""
    try:
        if cases.get("fn_name"):
            module = types.ModuleType("solution")
            module.__file__ = SOLUTION_FILE
            sys.modules["solution"] = module
            exec(code, module.__dict__)
            fn = getattr(module, cases["fn_name"], None)
            if fn is None and hasattr(module, "Solution"):
                fn = getattr(module.Solution(), cases["fn_name"])
            args = cases["inputs"][index]
            if isinstance(args, str):
                args = json.loads(args)
            got = fn(*args) if isinstance(args, list) else fn(args)
            os.write(result_fd, value_digest(got).encode())
        else:
            module = types.ModuleType("__main__")
            module.__file__ = "main.py"
            sys.modules["__main__"] = module
            sys.argv = ["main.py"]
            exec(code, module.__dict__)
        status = 0
    except SystemExit as exc:
        status = _python_exit_code(exc)
    except BaseException:
        traceback.print_exc()
        status = 1
    _finish_like_python()
    return status


def _inputs(cases: dict) -> list[int]:
    """One open file per case to be its stdin, each already unlinked: the cases' inputs stay out of this
    process's memory (a forked child starts with it, under the same memory limit) and out of the directory."""
    if cases.get("fn_name"):
        return [os.open(os.devnull, os.O_RDONLY) for _ in range(cases["count"])]
    fds = []
    for index in range(cases["count"]):
        name = input_file(index)
        fds.append(os.open(name, os.O_RDONLY))
        os.unlink(name)
    return fds


def input_file(index: int) -> str:
    return f"case-{index}.in"


def _run_case(code, cases: dict, index: int, stdin_fd: int, deadline: float) -> dict:
    """One case in a forked child; what the host needs to score it."""
    limit_s = min(cases["time_limit_s"], max(0.0, deadline - time.monotonic()))
    if limit_s <= 0:
        return {
            "returncode": -signal.SIGKILL,
            "timed_out": True,
            "truncated": False,
            "stderr": "",
            "digest": "",
        }
    (out_r, out_w), (err_r, err_w), (res_r, res_w) = os.pipe(), os.pipe(), os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: the solution, never back into the harness
        status = 1
        try:
            os.setpgid(0, 0)
            for fd, target in ((stdin_fd, 0), (out_w, 1), (err_w, 2), (res_w, 3)):
                os.dup2(fd, target)
            os.closerange(4, 1 << 16)  # the other cases' inputs, the harness's pipes and its nonce
            _set_dumpable(1)  # the program's own /proc/self as in a run of its own; the harness stays closed
            cpu = cases["cpu_seconds"]
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            status = _run_solution(code, cases, index, 3)
        finally:
            os._exit(status)
    with contextlib.suppress(OSError):  # the child already did, or already exited
        os.setpgid(pid, pid)
    for fd in (stdin_fd, out_w, err_w, res_w):
        os.close(fd)
    kill_all = bool(cases.get("own_pid_namespace"))
    outputs = _collect(pid, (out_r, err_r, res_r), cases["max_output_bytes"], start + limit_s, kill_all)
    for fd in (out_r, err_r, res_r):
        os.close(fd)
    stdout, stderr, result = outputs["data"]
    if cases.get("fn_name"):
        digest = result.decode(errors="replace") if outputs["returncode"] == 0 else ""
    else:
        digest = text_digest(stdout.decode("utf-8", errors="replace"))
    return {
        "returncode": outputs["returncode"],
        "timed_out": outputs["timed_out"],
        "truncated": outputs["truncated"],
        "stderr": stderr[-4 * STDERR_TAIL :].decode("utf-8", errors="replace")[-STDERR_TAIL:],
        "digest": digest,
    }


def _set_dumpable(flag: int) -> None:
    """prctl(PR_SET_DUMPABLE): 0 keeps every other process of this user id out of this one's /proc entries
    (descriptors, memory) and from tracing it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, flag, 0, 0, 0)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(OSError):  # nothing left in it
        os.killpg(pid, signal.SIGKILL)


def _kill_leftovers(wait_s: float = 1.0) -> None:
    """Every process of the sandbox but its init and this one: what a case left outside its process group
    (``setsid``), so that the next case starts as in a sandbox of its own. Only where the host says the run has
    a PID namespace of its own (the local bwrap sandbox: then this harness is its second process), because
    kill(-1) reaches every process the caller may signal. Returns once they are dead (at most ``wait_s``): a
    SIGKILLed process is still listed, running, for a moment, and the next case could see it."""
    if os.getpid() != 2:
        return
    with contextlib.suppress(OSError):
        os.kill(-1, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while _others_alive() and time.monotonic() < deadline:
        time.sleep(0.002)


def _others_alive() -> bool:
    """Whether a process other than the namespace's init and this one is still alive (not yet a zombie)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (1, os.getpid()):
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone while we looked
        if state not in (b"Z", b"X"):
            return True
    return False


def _collect(pid: int, fds: tuple, cap: int, deadline: float, kill_all: bool) -> dict:
    """Read the child's pipes until it exits, its time is up or an output passes the cap; then kill what it
    left (its process group; with ``kill_all``, every other process of the sandbox) and reap it."""
    data = [bytearray(), bytearray(), bytearray()]
    selector = selectors.DefaultSelector()
    for i, fd in enumerate(fds):
        selector.register(fd, selectors.EVENT_READ, i)
    exited = _exit_fd(pid)  # readable when the child exits: no polling delay after each case
    if exited is not None:
        selector.register(exited, selectors.EVENT_READ, None)
    timed_out = truncated = False
    status = None
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for key, _ in selector.select(min(left, 0.05 if exited is not None else 0.001)):
            if key.data is not None and _read_into(selector, key, data[key.data], cap):
                truncated = True
        if truncated:
            break
        waited, raw = os.waitpid(pid, os.WNOHANG)
        status = raw if waited else None
    if exited is not None:
        selector.unregister(exited)
        os.close(exited)
    _kill_group(pid)
    if kill_all:
        _kill_leftovers()
    if status is None:
        status = os.waitpid(pid, 0)[1]
    _drain(selector, data, cap)
    selector.close()
    return {
        "returncode": os.waitstatus_to_exitcode(status),
        "timed_out": timed_out,
        "truncated": truncated,
        "data": [bytes(d) for d in data],
    }


def _exit_fd(pid: int):
    """A pidfd of the child (Linux 5.3+), or None where there is none (then the loop polls)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _read_into(selector, key, buffer: bytearray, cap: int) -> bool:
    """One read of a pipe into its buffer, kept to ``cap``; whether the output went past the cap."""
    chunk = os.read(key.fd, 65536)
    if not chunk:
        selector.unregister(key.fd)
        return False
    room = cap - len(buffer)
    buffer += chunk[: max(room, 0)]
    return len(chunk) > room


def _drain(selector, data: list, cap: int) -> None:
    """What the child wrote just before it exited (a process it left behind may hold a pipe: give up soon)."""
    end = time.monotonic() + 0.2
    while selector.get_map() and time.monotonic() < end:
        for key, _ in selector.select(0.01):
            _read_into(selector, key, data[key.data], cap)


def _write(data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(1, view) :]


def _alive() -> None:
    """A sign of life for the host: a case begins (see the module's docstring)."""
    _write(b"\n")


def main() -> None:
    _set_dumpable(0)
    nonce_fd = os.open(NONCE_FILE, os.O_RDONLY)
    os.unlink(NONCE_FILE)
    with open(CASES_FILE, encoding="utf-8") as f:
        cases = json.load(f)
    os.unlink(CASES_FILE)
    stdin_fds = _inputs(cases)
    with open(SOLUTION_FILE, "rb") as f:
        source = f.read()  # bytes: a coding declaration applies, as when Python runs the file
    _alive()
    report: dict = {"compile_error": None, "cases": []}
    try:
        code = compile(source, SOLUTION_FILE if cases.get("fn_name") else "main.py", "exec")
    except (SyntaxError, ValueError) as exc:
        report["compile_error"] = f"{type(exc).__name__}: {exc}"[:500]
        code = None
    if code is not None:
        deadline = time.monotonic() + cases["time_limit_s"] * len(
            stdin_fds
        )  # the run's limit, less its start
        for index, stdin_fd in enumerate(stdin_fds):
            _alive()
            case = _run_case(code, cases, index, stdin_fd, deadline)
            report["cases"].append(case)
            if case["timed_out"] or case["returncode"] == -signal.SIGXCPU:
                break  # the host runs the cases left in parallel: a looping program costs no more time
    nonce = os.pread(nonce_fd, 256, 0).decode()
    line = "\n" + REPORT_MARKER + nonce + " " + json.dumps(report, ensure_ascii=False) + "\n"
    _write(line.encode("utf-8", errors="replace"))  # whatever the locale's encoding


if __name__ == "__main__":
    main()
