"""One run per run directory: every command that writes ``trainer.run_dir`` (`posttrain train`, `posttrain sft`,
`posttrain rm`, `posttrain eval`) holds an exclusive lock on it while it runs, taken through one entry point,
:func:`lock_run_dir`; a model exported outside the run directory (``sft.output_dir``, ``rm.output_dir``) is
locked too (:func:`lock_output_dir`), so two runs with different run directories cannot replace each other's
model.

Two runs writing the same directory would interleave metrics, overwrite each other's config and prune each
other's checkpoints. The lock is an ``fcntl.flock`` on ``run_dir/.lock``, held through a file descriptor kept
open for the run: the kernel releases it when the process ends, however it ends (a crash or SIGKILL
included), so a lock file left behind by a dead run is stale by construction and is simply taken over. The
file's text (pid, host, start time) is only there to name the holder in the second run's error.

flock is per host on many network filesystems: two runs on different nodes sharing a run_dir over NFS may
both get it. Within a distributed job only rank 0 takes the lock.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
from pathlib import Path
from typing import IO

from posttrain.config.errors import ConfigError
from posttrain.utils.storage import storage_errors

LOCK_FILENAME = ".lock"
log = logging.getLogger("posttrain")

try:  # flock is POSIX; elsewhere the lock is skipped (documented in docs/reliability.md)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


class RunDirLock:
    """An exclusive lock on a run directory; :meth:`release` (or process exit) frees it."""

    def __init__(
        self, run_dir: str | os.PathLike, key: str = "trainer.run_dir", lock_file: Path | None = None
    ) -> None:
        self.target = Path(run_dir)  # the directory locked (named in the second run's error)
        self.path = lock_file or self.target / LOCK_FILENAME
        self.key = key
        self.file: IO[str] | None = None
        self.replaced_stale: dict | None = None

    def acquire(self) -> RunDirLock:
        """Take the lock or raise ConfigError naming the live holder (pid, host, start time)."""
        if fcntl is None:
            return self
        with storage_errors(self.path.parent, "the run directory's lock file"):  # e.g. a read-only run_dir
            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the whole run
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(f)
            f.close()
            raise ConfigError(_held_message(self.key, self.target, holder)) from None
        # We hold it: any text left in the file is from a run that ended without releasing (killed).
        self.replaced_stale = _read_holder(f) or None
        if self.replaced_stale:
            log.info("%s: took over a stale lock; its holder %s is gone", self.path, self.replaced_stale)
        f.seek(0)
        f.truncate()
        f.write(json.dumps(_me()) + "\n")
        f.flush()
        self.file = f
        return self

    def release(self) -> None:
        if self.file is None:
            return
        with contextlib.suppress(OSError):
            self.file.seek(0)
            self.file.truncate()  # an empty file: nobody holds it
            fcntl.flock(self.file.fileno(), fcntl.LOCK_UN)
        self.file.close()
        self.file = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def lock_run_dir(run_dir: str | os.PathLike, take: bool = True) -> RunDirLock | None:
    """The lock every command that writes a run directory takes, before it writes anything there; ``take``:
    False on the ranks of a distributed job other than 0 (rank 0 speaks for the job). ConfigError when held."""
    return RunDirLock(run_dir).acquire() if take else None


def lock_output_dir(
    output_dir: str | os.PathLike, key: str, run_dir: str | os.PathLike, take: bool = True
) -> RunDirLock | None:
    """The lock of a command's export directory ``output_dir`` (config key ``key``) when it lies outside
    ``run_dir`` (inside, the run lock covers it): ``.NAME.lock`` beside it, since the export replaces the
    directory itself by a rename. None when not needed or ``take`` is False. ConfigError when held."""
    out, run = Path(output_dir).resolve(), Path(run_dir).resolve()
    if not take or out == run or run in out.parents:
        return None
    return RunDirLock(out, key, lock_file=out.parent / f".{out.name}{LOCK_FILENAME}").acquire()


def _me() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def _read_holder(f: IO[str]) -> dict:
    f.seek(0)
    try:
        data = json.loads(f.read() or "{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _held_message(key: str, run_dir: Path, holder: dict) -> str:
    who = (
        f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (started {holder.get('started', '?')})"
        if holder
        else "another process"
    )
    return (
        f"{key}={run_dir} is in use by {who}: two runs writing one directory would overwrite each other's "
        f"files (config, metrics, checkpoints, the model). Wait for that run to end (or stop it), or choose "
        f"another {key}"
    )
