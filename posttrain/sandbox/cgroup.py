"""A control group per sandbox run, where the caller may make one (as root, cgroup v1 or v2): the whole run's
memory (its processes, the kernel memory they cause, such as the inodes of a million empty files, and its
tmpfs) is capped at ``2 x memory_limit_mb + max_disk_mb``, and the run gets at most one core, so its CPU time is
bounded by its wall-clock time however many processes it forks.

The rlimits of :mod:`posttrain.sandbox.process` hold per process; without a cgroup (an ordinary user, or a
machine without a writable cgroup tree) a run's memory is bounded only by ``max_processes`` x
``memory_limit_mb`` and its CPU by its wall-clock limit times the cores it gets (docs/sandbox.md).

A run joins its group before bwrap starts: a small shell writes its own pid into the group and then execs
bwrap, so every process of the run is in it from its first instruction. The group is removed after the run;
one left by a caller that was killed is removed by the next sandbox built on the machine (:func:`sweep`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PREFIX = "posttrain-sandbox-"
_PERIOD_US = 100_000
_COUNTER = itertools.count()
# The shell that joins the group: writes its pid to each file named before "--", then execs what follows.
_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


def _own_path(controller: str) -> str | None:
    """This process's group in ``controller``'s hierarchy (v1), or in the unified one (``controller=""``)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if (controller and controller in names.split(",")) or (not controller and names == ""):
            return path
    return None


def _parents() -> dict[str, Path] | None:
    """The directories a run's groups go under, per controller: {"memory": ..., "cpu": ...} (v1) or
    {"": ...} (v2); None where no writable tree with those controllers exists."""
    if (ROOT / "cgroup.controllers").exists():  # v2: one tree; a group may hold processes only at a leaf
        own = _own_path("")
        if own is None:
            return None
        parent = ROOT / own.lstrip("/")
        controllers = (parent / "cgroup.subtree_control").read_text().split() if parent.exists() else []
        if not {"memory", "cpu"} <= set(controllers) or not os.access(parent, os.W_OK):
            return None
        return {"": parent}
    out = {}
    for controller in ("memory", "cpu"):
        own = _own_path(controller)
        base = ROOT / controller
        if own is None or not base.is_dir():
            return None
        parent = base / own.lstrip("/")
        if not os.access(parent, os.W_OK):
            return None
        out[controller] = parent
    return out


class RunGroup:
    """The group (v2) or groups (v1, one per controller) of one run."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        self.dirs = dirs

    @classmethod
    def create(cls, memory_bytes: int) -> RunGroup | None:
        """A fresh group capping memory at ``memory_bytes`` and CPU at one core; None where none can be made."""
        parents = _parents()
        if parents is None:
            return None
        name = f"{PREFIX}{os.getpid()}-{next(_COUNTER)}"
        group = cls({controller: parent / name for controller, parent in parents.items()})
        try:
            for path in group.dirs.values():
                path.mkdir()
            group._limit(memory_bytes)
        except OSError:
            group.remove()
            return None
        return group

    def _limit(self, memory_bytes: int) -> None:
        if "" in self.dirs:
            d = self.dirs[""]
            (d / "memory.max").write_text(str(memory_bytes))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
            (d / "cpu.max").write_text(f"{_PERIOD_US} {_PERIOD_US}")
            return
        memory, cpu = self.dirs["memory"], self.dirs["cpu"]
        (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
        with contextlib.suppress(OSError):  # absent without swap accounting
            (memory / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
        (cpu / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
        (cpu / "cpu.cfs_quota_us").write_text(str(_PERIOD_US))

    def join_argv(self) -> list[str]:
        """The argv prefix that puts what follows it into the group before it starts."""
        return ["/bin/sh", "-c", _JOIN, "sh", *(str(d / "cgroup.procs") for d in self.dirs.values()), "--"]

    def oom_kills(self) -> int:
        """How many processes the kernel killed for the group's memory cap."""
        if "" in self.dirs:
            text, key = _read(self.dirs[""] / "memory.events"), "oom_kill"
        else:
            text, key = _read(self.dirs["memory"] / "memory.oom_control"), "oom_kill"
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
        return 0

    def remove(self) -> None:
        """Remove the group (its processes are gone: the run waited for its namespace)."""
        for path in self.dirs.values():
            _remove(path)


def _kill_members(path: Path) -> None:
    """SIGKILL every process in the group at ``path`` (its owner is dead: nothing in it is anyone's run)."""
    for pid in _read(path / "cgroup.procs").split():
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _remove(path: Path, timeout_s: float = 2.0) -> None:
    """rmdir, retried briefly: the kernel may still be tearing a killed process out of the group."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)


def sweep() -> int:
    """Remove the groups of sandboxes whose process is gone (a caller killed mid-run), killing what they still
    hold first (a caller killed while bwrap was starting left bwrap waiting for a child that was gone); how many."""
    parents = _parents()
    if parents is None:
        return 0
    removed = 0
    for parent in parents.values():
        for path in parent.glob(PREFIX + "*"):
            owner = path.name[len(PREFIX) :].split("-", 1)[0]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                _kill_members(path)
                _remove(path, timeout_s=0.5)
                removed += not path.exists()
    return removed
