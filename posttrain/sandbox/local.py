"""The local backend: each run in a fresh bubblewrap sandbox on this machine (or, only when a setting whose
name says so asks for it, as a bare subprocess with rlimits and nothing else)."""

from __future__ import annotations

import functools
import os
import subprocess
import tempfile
import threading
from dataclasses import replace
from pathlib import Path

from posttrain.config.errors import ConfigError
from posttrain.sandbox import cgroup
from posttrain.sandbox.bwrap import (
    _fds,
    bwrap_argv,
    check_bwrap,
    find_bwrap,
    inside_env,
    python_binary,
    seccomp_fd,
    wait_for_namespace,
)
from posttrain.sandbox.cgroup import RunGroup
from posttrain.sandbox.process import PRLIMIT, rlimit_argv, run_command
from posttrain.sandbox.types import (
    ERROR,
    HARNESS_START_S,
    MEMORY_LIMIT,
    SOURCE_NAMES,
    Limits,
    RunRequest,
    RunResult,
    file_name_problem,
    file_tree_problem,
    unsupported_language,
)

_MIB = 1024 * 1024
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
        # a lock another thread held when this process forked would stay locked in the child for ever
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self.lock = threading.Lock()

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

    def __init__(
        self,
        limits: Limits | None = None,
        bwrap_path: str = "",
        unsafe_no_isolation: bool = False,
        use_cgroups: bool = True,
    ):
        self.limits = limits or Limits()
        self.unsafe = unsafe_no_isolation
        self.own_pid_namespace = (
            not self.unsafe
        )  # bwrap --unshare-pid: the program and bwrap's init, nothing else
        self.as_root = os.geteuid() == 0
        self.bwrap = ""
        self.cgroups = False  # a control group per run: the whole run's memory and CPU capped
        if not self.unsafe:
            self.bwrap = find_bwrap(bwrap_path)
            check_bwrap(self.bwrap, self.as_root)
            self.cgroups = self.as_root and use_cgroups
            if self.cgroups:
                cgroup.sweep()  # groups left by a caller that was killed mid-run

    def describe(self) -> str:
        if self.unsafe:
            return "local, UNSAFE: no isolation (sandbox.unsafe_no_isolation=true)"
        user = "own user id per sandbox" if self.as_root else "user namespace"
        group = "; a cgroup per run where one can be made" if self.cgroups else ""
        return f"local bubblewrap ({self.bwrap}; {user}{group})"

    def run(self, request: RunRequest, cancel: threading.Event | None = None) -> RunResult:
        """One run; ``cancel``, when set, ends it early with status sandbox_error (a client that went away)."""
        if refused := unsupported_language(request):
            return refused
        files = staged_files(request)
        limits = request.limits(self.limits)
        size = sum(map(len, files.values()))
        if not self.unsafe and size > limits.max_disk_mb * _MIB:
            raise ConfigError(
                f"the run's files hold {size} bytes, more than its /tmp of sandbox.max_disk_mb="
                f"{limits.max_disk_mb} MiB; send less, or raise sandbox.max_disk_mb"
            )
        if self.unsafe:
            return self._run_unisolated(request, files, limits, cancel)
        uid = _UIDS.take() if self.as_root else None
        try:
            return self._execute(request, files, limits, uid, cancel)
        finally:
            if uid is not None:
                _UIDS.give(uid)

    def _execute(
        self,
        request: RunRequest,
        files: dict[str, bytes],
        limits: Limits,
        uid: int | None,
        cancel: threading.Event | None,
    ) -> RunResult:
        """One run in bwrap. Its files are handed in as descriptors and copied into its tmpfs: nothing of the
        run is on the host's disk, so nothing is left when the run (or this process) dies."""
        staged = [(_memfd(data), name) for name, data in files.items()]
        filter_fd = seccomp_fd()
        info_read, info_write = os.pipe()
        fds = (info_write, *_fds(filter_fd), *(fd for fd, _ in staged))
        group = RunGroup.create(run_memory_bytes(limits)) if self.cgroups else None
        try:
            argv = (group.join_argv() if group else []) + bwrap_argv(
                self.bwrap,
                rlimit_argv(limits),
                program_argv(request.language),
                uid,
                disk_bytes=limits.max_disk_mb * _MIB,
                staged=staged,
                seccomp_fd=filter_fd,
                info_fd=info_write,
            )
            result = run_command(
                argv,
                limits,
                stdin=request.stdin.encode(),
                signal_offset=128,
                pass_fds=fds,
                progress_limit_s=self._progress_limit(request),
                cancel=cancel,
            )
        finally:
            for fd in fds:
                os.close(fd)
        wait_for_namespace(info_read)  # nothing of the run is left, not even a process the kernel is removing
        if group is not None:
            if group.oom_kills() and result.status == ERROR:  # the program died of it, not only a child
                result = replace(result, status=MEMORY_LIMIT)
            group.remove()
        return result

    def _progress_limit(self, request: RunRequest) -> float | None:
        """A run of several executions writes to stdout as each begins (:attr:`RunRequest.executions`): one
        that stays silent for longer than an execution may take is stopped then, not at the whole run's limit
        (a program that stops its harness gains nothing)."""
        return self.limits.time_limit_s + HARNESS_START_S if request.executions > 1 else None

    def _run_unisolated(
        self, request: RunRequest, files: dict[str, bytes], limits: Limits, cancel: threading.Event | None
    ) -> RunResult:
        """sandbox.unsafe_no_isolation: a plain subprocess in a directory of its own, removed afterwards."""
        workdir = tempfile.mkdtemp(prefix="posttrain-unisolated-")
        try:
            for name, data in files.items():
                target = Path(workdir, name)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            env = {**inside_env(), "HOME": workdir, "TMPDIR": workdir}
            program, stdin = program_argv(request.language), request.stdin.encode()
            run = functools.partial(run_command, stdin=stdin, env=env, cwd=workdir, cancel=cancel)
            if os.path.exists(PRLIMIT):
                return run(rlimit_argv(limits) + program, limits)
            return run(program, limits, preexec_limits=True)
        finally:
            # rm, not shutil.rmtree: Python 3.11's rmtree recurses, and a deep tree the code made would raise
            subprocess.run(["rm", "-rf", "--", workdir], check=False, capture_output=True)


def run_memory_bytes(limits: Limits) -> int:
    """The whole run's memory cap (its cgroup's): twice one process's address-space limit (a harness beside a
    case at its limit; a parent beside a child) plus the tmpfs, whose pages count against it too."""
    return (2 * limits.memory_limit_mb + limits.max_disk_mb) * _MIB


def program_argv(language: str) -> list[str]:
    source = SOURCE_NAMES[language]
    return [python_binary(), source] if language == "python" else ["/bin/bash", source]


def staged_files(request: RunRequest) -> dict[str, bytes]:
    """The files a run starts with (its program first), names checked; a ConfigError for a name that cannot be
    a file of the sandbox's directory."""
    source = SOURCE_NAMES[request.language]
    for name in request.files:
        problem = file_name_problem(name, source)
        if problem:
            raise ConfigError(f"sandbox file name {name!r}: {problem}")
    tree = file_tree_problem(list(request.files))
    if tree:
        raise ConfigError(f"sandbox files: {tree[0]!r} {tree[1]}" if tree[0] else f"sandbox files: {tree[1]}")
    return {source: request.code.encode(), **request.files}


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("posttrain-sandbox-file", 0)
    view = memoryview(data)
    while view:  # os.write may write less than asked
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
