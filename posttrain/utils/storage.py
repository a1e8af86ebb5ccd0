"""Writing what a run leaves behind: a directory published whole or not at all, and a full or read-only disk
reported as a user error naming the path.

- :func:`atomic_dir` writes a directory (an exported model) under a hidden name beside it and renames it into
  place when every file is written: a crash, a kill or a full disk never leaves a half-written export under the
  real name. A hidden ``.NAME.partial-<pid>`` left by a killed writer is never read and the next write of NAME
  deletes it.
- :func:`storage_errors` turns the errors a full or read-only filesystem raises (``OSError`` ENOSPC, EROFS,
  EDQUOT, and the ``RuntimeError`` / ``SafetensorError`` that torch's and safetensors' writers wrap them in)
  into a :class:`StorageError`: the CLI prints one line and exits 2.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from posttrain.config.errors import ConfigError

_PARTIAL = ".partial-"
_OLD = ".old-"
# errno -> what the message says
_KNOWN = {errno.ENOSPC: "no space left", errno.EDQUOT: "no space left (disk quota)", errno.EROFS: "read-only"}
# Libraries that wrap the OSError in their own exception keep only its text (torch's zip writer says no more
# than "unexpected pos"): read those texts.
_TEXTS = (
    ("no space left", "no space left"),
    ("disk quota", "no space left (disk quota)"),
    ("read-only file system", "read-only"),
    ("unexpected pos", "no space left"),
    ("file write failed", "no space left"),
)


class StorageError(ConfigError):
    """A file could not be written: the filesystem is full or read-only (the message names the path)."""


def storage_problem(exc: BaseException) -> str | None:
    """ "no space left" / "read-only" when ``exc`` (or an exception it was raised from) says so, else None."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in _KNOWN:
            return _KNOWN[exc.errno]
        text = str(exc).lower()
        for needle, what in _TEXTS:
            if needle in text:
                return what
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


@contextlib.contextmanager
def storage_errors(path: str | os.PathLike, what: str, note: str = "") -> Iterator[None]:
    """Re-raise a full or read-only filesystem under this block as a StorageError naming ``path`` (and
    ``note``: e.g. what is still intact); anything else passes through unchanged."""
    try:
        yield
    except BaseException as exc:  # OSError, or what a writer wraps it in (DCP: a BaseException)
        problem = storage_problem(exc)
        if problem is None:
            raise
        raise StorageError(
            f"writing {what} to {path} failed: {problem} ({_first_line(exc)}){note}; "
            "free space on that filesystem or make it writable (or choose another trainer.run_dir), then run "
            "the same command again"
        ) from exc


def _first_line(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        exc = inner[0] if isinstance(inner, tuple) else inner
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else repr(exc)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, what: str = "the model") -> Iterator[Path]:
    """Yield a hidden directory beside ``path`` to write into; when the block ends without an error it replaces
    ``path`` (an older one is removed), else it is deleted. A full or read-only disk is a StorageError."""
    path = Path(path)
    with storage_errors(path, what):
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}{_PARTIAL}*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = path.parent / f".{path.name}{_PARTIAL}{os.getpid()}"
        tmp.mkdir()
        try:
            yield tmp
            _publish(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, path: Path) -> None:
    if not path.exists():
        os.replace(tmp, path)
        return
    old = path.parent / f".{path.name}{_OLD}{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def model_dir_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a whole exported model: a config (config.json or a LoRA adapter's
    adapter_config.json) and its weights (safetensors, one file or an index of shards)."""
    path = Path(path)
    if (path / "adapter_config.json").is_file():
        return (path / "adapter_model.safetensors").is_file()
    if not (path / "config.json").is_file():
        return False
    index = path / "model.safetensors.index.json"
    return (path / "model.safetensors").is_file() or index.is_file()
