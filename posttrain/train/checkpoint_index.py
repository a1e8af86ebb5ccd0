"""Where checkpoints live in a run directory and which one to resume: names, the `latest` pointer, the complete
and intact ones (a checkpoint is complete once published, intact once its checksums verify)."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

from posttrain.config.errors import CheckpointError
from posttrain.train.integrity import read_json_file, verify_files

CHECKPOINTS_DIRNAME = "checkpoints"
LATEST_FILENAME = "latest"
COMPLETE_FILENAME = "COMPLETE"
MANIFEST_FILENAME = "manifest.json"
TRAINER_STATE_FILENAME = "trainer_state.json"
RNG_FILENAME = "rng.pt"
LAYOUT = "dcp"
FORMAT_VERSION = 2
STATE_DIRNAME = "state"
RESUME_MODES = ("auto", "disable")

_STEP_RE = re.compile(r"^step_(\d+)$")
# An older copy of a step moved aside while the same step is saved again (see _publish).
_REPLACED_RE = re.compile(r"^\.replaced-(step_\d+)-\d+$")
_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


# --------------------------------------------------------------------------- discovery


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    """The directory holding all checkpoints of a run: ``run_dir/checkpoints``."""
    return Path(run_dir) / CHECKPOINTS_DIRNAME


def step_dirname(step: int) -> str:
    """Directory name of the checkpoint for ``step`` (``step_000012``)."""
    return f"step_{step:06d}"


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` holds a checkpoint whose save finished (manifest and COMPLETE marker)."""
    path = Path(path)
    return (path / COMPLETE_FILENAME).is_file() and (path / MANIFEST_FILENAME).is_file()


def _complete_by_step(root: Path) -> dict[int, Path]:
    """Complete checkpoints under ``root`` keyed by step, in ascending step order."""
    found: dict[int, Path] = {}
    aside: dict[int, Path] = {}
    if not root.is_dir():
        return found
    for entry in root.iterdir():
        if (match := _STEP_RE.match(entry.name)) and is_complete_checkpoint(entry):
            found[int(match.group(1))] = entry
        elif (match := _REPLACED_RE.match(entry.name)) and is_complete_checkpoint(entry):
            aside[int(match.group(1)[len("step_") :])] = entry
    # A crash between the two renames of a same-step re-save leaves only the moved-aside copy.
    for step, entry in aside.items():
        found.setdefault(step, entry)
    return dict(sorted(found.items()))


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest step first. Temporary and partial directories are skipped."""
    return list(_complete_by_step(checkpoint_root(run_dir)).values())


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names, else the highest complete step, else None.

    The pointer wins over the highest step because a run resumed from an older checkpoint keeps the
    abandoned later steps on disk; ``latest`` is what the most recent save wrote.
    """
    root = checkpoint_root(run_dir)
    complete = _complete_by_step(root)
    if not complete:
        return None
    pointed = _read_latest(root)
    match = _STEP_RE.match(pointed)
    if match and int(match.group(1)) in complete:
        return complete[int(match.group(1))]
    return complete[max(complete)]


def _read_latest(root: Path) -> str:
    """The checkpoint name in ``latest`` ('' when absent); garbage there is a CheckpointError naming it."""
    path = root / LATEST_FILENAME
    try:
        pointed = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return ""
    except (OSError, UnicodeDecodeError) as err:
        pointed = f"<unreadable: {err}>"
    if not _STEP_RE.match(pointed):
        raise CheckpointError(
            f"{path} is damaged: it holds {pointed[:60]!r}, not a checkpoint name like 'step_000012'. Delete it "
            "(resume=auto then takes the highest complete step) or write the name of a checkpoint into it"
        )
    return pointed


def _newest_intact(run_dir: str | os.PathLike) -> Path | None:
    """The latest checkpoint whose files all verify, newest first; each damaged one is skipped with a
    warning naming its damaged file (its directory is left alone for inspection)."""
    _warn_incomplete(checkpoint_root(run_dir))
    newest = latest_checkpoint(run_dir)
    candidates = [newest] if newest is not None else []
    candidates += [p for p in reversed(list_checkpoints(run_dir)) if p != newest]
    damaged = []
    for path in candidates:
        try:
            verify_files(path, read_manifest(path))
        except CheckpointError as err:
            warnings.warn(f"skipping damaged checkpoint: {err}", stacklevel=3)
            damaged.append(path.name)
            continue
        return path
    if damaged:
        # Starting fresh here would train over (and prune) checkpoints someone may want to repair.
        raise CheckpointError(
            f"every checkpoint in {checkpoint_root(run_dir)} is damaged ({damaged}; see the warnings above); "
            "set trainer.resume=disable to start fresh, or use a new trainer.run_dir"
        )
    return None


def _warn_incomplete(root: Path) -> None:
    """A published ``step_*`` directory is complete when it appears: one without its manifest or COMPLETE
    marker lost a file afterwards. resume=auto passes over it; say so, naming it and what is missing."""
    if not root.is_dir():
        return
    for entry in sorted(root.iterdir()):
        if not (_STEP_RE.match(entry.name) and entry.is_dir()) or is_complete_checkpoint(entry):
            continue
        missing = [n for n in (MANIFEST_FILENAME, COMPLETE_FILENAME) if not (entry / n).is_file()]
        warnings.warn(
            f"skipping checkpoint {entry}: {' and '.join(missing)} missing (deleted, or its save never finished); "
            "resume=auto takes the newest complete one",
            stacklevel=4,
        )


def find_checkpoint(run_dir: str | os.PathLike, resume: str) -> Path | None:
    """Resolve ``resume``: ``auto`` (latest complete checkpoint or None), ``disable`` (None) or a path.

    A relative path that does not exist is also tried under ``run_dir/checkpoints``, so
    ``resume=step_000012`` names a checkpoint of this run. The checkpoint returned has been verified
    (:mod:`posttrain.train.integrity`): ``auto`` falls back to the newest intact one with a warning naming
    each damaged one; a named checkpoint that is damaged is a CheckpointError naming the file. With several
    ranks, rank 0 alone reads the files and every rank gets its answer (or its error).
    """
    if resume == "disable":
        return None
    error, found = None, None
    if _is_main():
        try:
            found = _resolve(run_dir, resume)
        except CheckpointError as err:
            error = str(err)
    error, found = _from_main((error, found))
    if error is not None:
        raise CheckpointError(error)
    return found


def _resolve(run_dir: str | os.PathLike, resume: str) -> Path | None:
    if resume == "auto":
        return _newest_intact(run_dir)
    if not isinstance(resume, str) or not resume:
        raise CheckpointError(
            f"resume={resume!r} is not valid; use one of {RESUME_MODES} or a checkpoint path"
        )
    candidate = _resume_target(run_dir, resume)
    verify_files(candidate, read_manifest(candidate))
    return candidate


def check_resume_setting(run_dir: str | os.PathLike, resume: str) -> None:
    """trainer.resume, before anything loads: ``auto``, ``disable`` or a complete checkpoint (its files are
    verified when it is loaded). CheckpointError naming what is available otherwise."""
    if resume not in RESUME_MODES:
        _resume_target(run_dir, resume)


def _resume_target(run_dir: str | os.PathLike, resume: str) -> Path:
    """The complete checkpoint ``resume`` names (a path, or a name under run_dir/checkpoints)."""
    candidate = Path(resume).expanduser()
    if not candidate.exists() and not candidate.is_absolute():
        candidate = checkpoint_root(run_dir) / resume
    if is_complete_checkpoint(candidate):
        return candidate
    reason = (
        "does not exist" if not candidate.exists() else "is not a complete checkpoint (interrupted save?)"
    )
    available = [p.name for p in list_checkpoints(run_dir)] or "none"
    raise CheckpointError(
        f"trainer.resume={resume!r}: {candidate} {reason}. Available checkpoints in "
        f"{checkpoint_root(run_dir)}: {available}. Use trainer.resume=auto for the latest one or "
        "trainer.resume=disable to start fresh."
    )


# --------------------------------------------------------------------------- save


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _from_main(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (itself without torch.distributed)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete checkpoint; ValueError for partial or foreign directories."""
    path = Path(path)
    if not is_complete_checkpoint(path):
        complete = (
            [p.name for p in list_checkpoints(path.parent.parent)]
            if path.parent.name == "checkpoints"
            else []
        )
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {COMPLETE_FILENAME} marker or {MANIFEST_FILENAME}: its "
            f"save never finished, or a file was deleted); choose a complete one"
            + (
                f" of {path.parent}: {', '.join(complete)}"
                if complete
                else " (a checkpoints/step_* directory)"
            )
        )
    manifest = read_json_file(path / MANIFEST_FILENAME, "the checkpoint's manifest")
    if not isinstance(manifest, dict) or not all(
        isinstance(manifest.get(k), list) for k in ("modules", "optimizers", "schedulers")
    ):
        raise CheckpointError(
            f"checkpoint file {path / MANIFEST_FILENAME} is damaged: not a manifest written by posttrain; "
            "resume from another checkpoint"
        )
    if manifest.get("layout") != LAYOUT or manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has layout={manifest.get('layout')!r}, "
            f"format_version={manifest.get('format_version')!r}; this loader reads layout={LAYOUT!r} "
            f"up to format_version={FORMAT_VERSION}"
        )
    return manifest
