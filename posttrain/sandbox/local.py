"""The local backend: each run in a fresh bubblewrap sandbox on this machine (or, only when a setting whose
name says so asks for it, as a bare subprocess with rlimits and nothing else)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

from posttrain.config.errors import ConfigError
from posttrain.sandbox.bwrap import (
    bwrap_argv,
    check_bwrap,
    find_bwrap,
    inside_env,
    python_binary,
    wait_for_namespace,
)
from posttrain.sandbox.process import PRLIMIT, rlimit_argv, run_command
from posttrain.sandbox.types import LANGUAGES, SANDBOX_ERROR, Limits, RunRequest, RunResult

SOURCE_NAMES = {"python": "main.py", "bash": "main.sh"}
_UID_BASE = 1_000_000_000  # far above any real account's user id
_UIDS_PER_PROCESS = 256


class _UidPool:
    """User ids no other sandbox of any process uses at the same time: RLIMIT_NPROC counts processes per user,
    so a fork bomb in one sandbox cannot take another's process budget."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free: list[int] = []
        self.next = 0
        self.pid = -1

    def take(self) -> int:
        with self.lock:
            if self.pid != os.getpid():  # a forked child starts its own range
                self.pid, self.free, self.next = os.getpid(), [], 0
            if self.free:
                return self.free.pop()
            slot = self.next % _UIDS_PER_PROCESS
            self.next += 1
            return _UID_BASE + (os.getpid() % (1 << 22)) * _UIDS_PER_PROCESS + slot

    def give(self, uid: int) -> None:
        with self.lock:
            self.free.append(uid)


_UIDS = _UidPool()


def sandbox_user_pids() -> list[int]:
    """Processes running under one of this process's sandbox user ids (as root only: only its sandboxes use those
    ids; another process's sandboxes have ids of their own). What the tests and the benchmark count as left."""
    first = _UID_BASE + (os.getpid() % (1 << 22)) * _UIDS_PER_PROCESS
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if first <= os.stat(f"/proc/{entry}").st_uid < first + _UIDS_PER_PROCESS:
                    out.append(int(entry))
            except FileNotFoundError:
                pass  # it exited while we looked
    return out


class LocalSandbox:
    """Runs programs on this machine. ``run`` is thread-safe; concurrency is the caller's (see ``Sandbox``)."""

    name = "local"

    def __init__(self, limits: Limits | None = None, bwrap_path: str = "", unsafe_no_isolation: bool = False):
        self.limits = limits or Limits()
        self.unsafe = unsafe_no_isolation
        self.own_pid_namespace = (
            not self.unsafe
        )  # bwrap --unshare-pid: the program and bwrap's init, nothing else
        self.as_root = os.geteuid() == 0
        self.bwrap = ""
        if not self.unsafe:
            self.bwrap = find_bwrap(bwrap_path)
            check_bwrap(self.bwrap, self.as_root)

    def describe(self) -> str:
        if self.unsafe:
            return "local, UNSAFE: no isolation (sandbox.unsafe_no_isolation=true)"
        user = "own user id per sandbox" if self.as_root else "user namespace"
        return f"local bubblewrap ({self.bwrap}; {user})"

    def run(self, request: RunRequest, cancel: threading.Event | None = None) -> RunResult:
        if request.language not in LANGUAGES:
            return RunResult(
                SANDBOX_ERROR, None, "", f"unsupported language {request.language!r}; {LANGUAGES}", 0.0
            )
        limits = request.limits(self.limits)
        uid = _UIDS.take() if self.as_root and not self.unsafe else None
        workdir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
        try:
            self._stage(workdir, request, uid)
            return self._execute(workdir, request, limits, uid, cancel)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            if uid is not None:
                _UIDS.give(uid)

    def _stage(self, workdir: str, request: RunRequest, uid: int | None) -> None:
        root = Path(workdir)
        (root / SOURCE_NAMES[request.language]).write_text(request.code)
        for name, data in request.files.items():
            target = (root / name).resolve()
            if not target.is_relative_to(root.resolve()):
                raise ConfigError(
                    f"sandbox file name {name!r} leaves the sandbox's directory; use a relative name"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        if uid is not None:
            for path in [root, *root.rglob("*")]:
                os.chown(path, uid, uid)

    def _execute(
        self,
        workdir: str,
        request: RunRequest,
        limits: Limits,
        uid: int | None,
        cancel: threading.Event | None,
    ) -> RunResult:
        source = SOURCE_NAMES[request.language]
        program = [python_binary(), source] if request.language == "python" else ["/bin/bash", source]
        stdin = request.stdin.encode()
        if self.unsafe:
            env = {**inside_env(), "HOME": workdir, "TMPDIR": workdir}
            if os.path.exists(PRLIMIT):
                return run_command(
                    rlimit_argv(limits) + program, limits, stdin=stdin, env=env, cwd=workdir, cancel=cancel
                )
            return run_command(
                program, limits, stdin=stdin, env=env, cwd=workdir, preexec_limits=True, cancel=cancel
            )
        info_read, info_write = os.pipe()
        try:
            argv = bwrap_argv(self.bwrap, workdir, rlimit_argv(limits), program, uid, info_fd=info_write)
            result = run_command(
                argv, limits, stdin=stdin, signal_offset=128, pass_fds=(info_write,), cancel=cancel
            )
        finally:
            os.close(info_write)
        wait_for_namespace(info_read)  # nothing of the run is left, not even a process the kernel is removing
        return result
