"""What the tests that run hostile code in the real bubblewrap sandbox share (tests/sandbox, and the code reward's
and the python tool's tests beside their code): the `sandbox` fixture's limits (tests/conftest.py; where no
bwrap works it skips, saying why, except in CI (CI=true), where that is an error), and counts of what a run left.
CI runs them as root and again as an ordinary user (.ci/sandbox-as-user): the few that only make sense in one
of the two are marked root_only or ordinary_user_only."""

import os
from multiprocessing import resource_tracker

import pytest

from posttrain.sandbox import Limits
from posttrain.sandbox.local import sandbox_user_pids

TIGHT = Limits(
    time_limit_s=5.0,
    memory_limit_mb=256,
    max_processes=16,
    max_file_size_mb=1,
    max_output_bytes=65536,
    max_disk_mb=16,
)


AS_ROOT = os.geteuid() == 0
root_only = pytest.mark.skipif(not AS_ROOT, reason="as root only: each run has a user id of its own")
ordinary_user_only = pytest.mark.skipif(AS_ROOT, reason="as an ordinary user only: a user namespace")


def namespace_pids() -> list[int]:
    """As an ordinary user, where the program keeps this user's id: this user's live processes in a PID
    namespace whose init is a sandbox's bwrap (its command line names the sandbox's host name)."""
    mine, inits, members = os.readlink("/proc/self/ns/pid"), set(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != os.getuid():
                continue
            ns = os.readlink(f"/proc/{entry}/ns/pid")
            with open(f"/proc/{entry}/status") as f:
                status = dict(line.split(":", 1) for line in f)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue  # it exited while we looked
        if ns == mine or status["State"].split()[0] == "Z":
            continue
        if status["NSpid"].split()[-1] == "1" and b"\0--hostname\0sandbox\0" in cmdline:
            inits.add(ns)
        members.append((int(entry), ns))
    return sorted(pid for pid, ns in members if ns in inits)


def sandbox_pids() -> list[int]:
    """Processes running in this process's sandboxes: as root those under its sandbox user ids (other
    processes' sandboxes have ids of their own); as an ordinary user those in a sandbox's PID namespace."""
    return sandbox_user_pids() if AS_ROOT else namespace_pids()


def child_pids() -> list[int]:
    """Live children of this process (a leftover bwrap would be one), not counting multiprocessing's resource
    tracker, which an earlier test of the session may have started and which lives as long as this process."""
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and int(entry) != tracker:
            out.append(int(entry))
    return out
