"""Atomic, resumable checkpoints, from one process or many (torch.distributed.checkpoint).

Layout (one directory per step, published by a single rename)::

    run_dir/checkpoints/
        latest                          # text: name of the newest complete checkpoint
        step_000012/
            state/                      # DCP: every module's weights and optimizer state, each rank's
                                        # shards in its own file, keyed by parameter name
            scheduler/<key>.pt          # torch.save(scheduler.state_dict())
            rng.pt                      # python, numpy, torch CPU (+ CUDA) generator states
            trainer_state.json          # step, sampler state, KL controller value, ...
            manifest.json               # layout, format version, keys, file sizes and sha256s
            COMPLETE                    # written last
        .tmp-step_000013-<pid>/         # a save in progress, or one that crashed: never loaded

Why this shape:

- Every ``step_*`` directory was complete when it appeared: it is written and fsynced under a hidden
  temporary name and then published with one ``os.replace``. A crash at any point leaves at most a
  hidden directory behind, which loaders ignore and the next save deletes.
- ``latest`` is replaced atomically after the publish, so it only ever names a complete checkpoint.
- Weights and optimizer state go through torch.distributed.checkpoint (:mod:`posttrain.train.sharded_state`):
  with several ranks each writes its own shards in parallel, and a checkpoint written by N ranks loads on
  M ranks (one included), resharded on the fly. Every rank must call save/load; rank 0 alone writes the
  small files, publishes and prunes. With several nodes, ``run_dir`` must be a shared filesystem.
- One writer per run directory: a save deletes hidden leftovers of any earlier save.
- Every file's sha256 is in the manifest (:mod:`posttrain.train.integrity`): a checkpoint is verified after
  it is published (before ``latest`` moves to it and before older ones are pruned) and before it is loaded;
  ``resume=auto`` skips a damaged one, with a warning naming the damaged file.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from posttrain.config.errors import CheckpointError
from posttrain.train.checkpoint_index import (  # noqa: F401 (re-exported: callers find them here)
    _KEY_RE,
    _REPLACED_RE,
    COMPLETE_FILENAME,
    FORMAT_VERSION,
    LATEST_FILENAME,
    LAYOUT,
    MANIFEST_FILENAME,
    RNG_FILENAME,
    STATE_DIRNAME,
    TRAINER_STATE_FILENAME,
    _complete_by_step,
    _from_main,
    _is_main,
    checkpoint_root,
    find_checkpoint,
    is_complete_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    read_manifest,
    step_dirname,
)
from posttrain.train.integrity import CHECKSUM_KEY, checksums, read_json_file, verify_files
from posttrain.train.rng_state import capture_rng_state, restore_rng_state
from posttrain.train.sharded_state import (
    load_module_state,
    load_state,
    module_shapes,
    save_state,
    saved_shapes,
)


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    modules: Mapping[str, nn.Module],
    optimizers: Mapping[str, Optimizer] | None = None,
    schedulers: Mapping[str, LRScheduler] | None = None,
    trainer_state: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write ``run_dir/checkpoints/step_<step>`` atomically and point ``latest`` at it.

    Args:
        modules: modules by key (e.g. ``{"policy": ..., "critic": ...}``); weights go to safetensors.
        optimizers, schedulers: keyed like ``modules``; their ``state_dict()`` goes through ``torch.save``.
        trainer_state: JSON-serialisable loop state (step, data sampler state, KL coefficient, ...).
        keep_last: after the new checkpoint is published, delete older ones so that at most this many
            remain. Checkpoints of later steps (left by a run resumed from further back) are kept.

    Returns:
        The published checkpoint directory.
    """
    optimizers, schedulers = dict(optimizers or {}), dict(schedulers or {})
    _check_save_args(step, modules, optimizers, schedulers, keep_last)
    state_json = _encode_trainer_state(trainer_state)
    root = checkpoint_root(run_dir)
    final = root / step_dirname(step)
    tmp = _from_main(_make_tmp_dir(root, final.name) if _is_main() else None)
    try:
        _write_model_state(tmp, modules, optimizers)  # every rank writes its shards
        error = None
        if _is_main():
            try:
                keys = {
                    "modules": sorted(modules),
                    "optimizers": sorted(optimizers),
                    "schedulers": sorted(schedulers),
                }
                _finish_and_publish(tmp, final, step, keys, schedulers, state_json)
                if keep_last is not None:
                    _prune(root, keep_last, step)
            except BaseException as exc:
                error = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                _from_main(error)  # other ranks learn whether the checkpoint was published
        elif (error := _from_main(None)) is not None:
            raise RuntimeError(f"rank 0 failed to write checkpoint {final}: {error}")
    except BaseException:
        if _is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _make_tmp_dir(root: Path, name: str) -> Path:
    """Rank 0: the hidden directory a save writes into, after deleting what earlier saves left behind."""
    root.mkdir(parents=True, exist_ok=True)
    _cleanup_stale(root)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    tmp.mkdir()
    return tmp


def _finish_and_publish(
    tmp: Path,
    final: Path,
    step: int,
    keys: dict[str, list[str]],
    schedulers: Mapping[str, LRScheduler],
    state_json: str,
) -> None:
    """Rank 0, after every rank wrote its shards: the small files and the manifest, then the publish, a read-back
    check and ``latest``."""
    files = _write_torch_states(tmp, "scheduler", {k: s.state_dict() for k, s in schedulers.items()})
    files.append(_write_rng_state(tmp))
    files.append(_write_text(tmp / TRAINER_STATE_FILENAME, state_json))
    files += sorted(p for p in (tmp / STATE_DIRNAME).rglob("*") if p.is_file())
    _write_manifest(tmp, step, keys, files)
    _publish(tmp, final)
    # Read back before anything relies on it: `latest` and pruning only follow a verified save.
    verify_files(final, read_manifest(final))
    _write_latest(final.parent, final.name)


def _check_save_args(
    step: int,
    modules: Mapping[str, nn.Module],
    optimizers: Mapping[str, Any],
    schedulers: Mapping[str, Any],
    keep_last: int | None,
) -> None:
    if not _is_int(step) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative int, e.g. step=12")
    if keep_last is not None and (not _is_int(keep_last) or keep_last < 1):
        raise CheckpointError(f"keep_last={keep_last!r} must be None (keep all) or an int >= 1")
    if not modules:
        raise CheckpointError("modules is empty; pass at least one module, e.g. modules={'policy': model}")
    for kind, mapping in (("modules", modules), ("optimizers", optimizers), ("schedulers", schedulers)):
        bad = [key for key in mapping if not isinstance(key, str) or not _KEY_RE.match(key)]
        if bad:
            raise ValueError(
                f"{kind} key {bad[0]!r} is not a usable file name; use e.g. 'policy' or 'critic-1'"
            )
    bad = [key for key, module in modules.items() if not isinstance(module, nn.Module)]
    if bad:
        raise ValueError(
            f"modules[{bad[0]!r}] is a {type(modules[bad[0]]).__name__}, expected a torch.nn.Module"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _encode_trainer_state(trainer_state: Mapping[str, Any] | None) -> str:
    """Serialise before touching the disk, so a bad value fails without leaving anything behind."""
    trainer_state = {} if trainer_state is None else trainer_state
    if not isinstance(trainer_state, Mapping):
        raise CheckpointError(f"trainer_state must be a dict, got {type(trainer_state).__name__}")
    try:
        return json.dumps(dict(trainer_state), indent=2, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"trainer_state is not JSON-serialisable ({err}); store plain numbers, strings, lists and "
            "dicts (e.g. float(tensor) instead of a tensor)"
        ) from err


def _fsync_path(path: Path) -> None:
    """Flush a file's or directory's metadata to disk; directories cannot be opened on Windows."""
    if path.is_dir() and os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, write: Callable[[BinaryIO], Any]) -> Path:
    """Write through ``write(file)`` and fsync, so a rename after this publishes real bytes."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    return path


def _write_text(path: Path, text: str) -> Path:
    return _write_durably(path, lambda f: f.write(text.encode("utf-8")))


def _torch_save(obj: Any, path: Path) -> Path:
    return _write_durably(path, lambda f: torch.save(obj, f))


def _write_model_state(
    ckpt_dir: Path, modules: Mapping[str, nn.Module], optimizers: Mapping[str, Optimizer]
) -> None:
    """Weights and optimizer state via DCP (each file fsynced by DCP's writer), then the directory."""
    save_state(ckpt_dir / STATE_DIRNAME, modules, optimizers)
    if _is_main():
        _fsync_path(ckpt_dir / STATE_DIRNAME)


def _write_torch_states(ckpt_dir: Path, kind: str, states: Mapping[str, Any]) -> list[Path]:
    if not states:
        return []
    (ckpt_dir / kind).mkdir()
    paths = [_torch_save(state, ckpt_dir / kind / f"{key}.pt") for key, state in states.items()]
    _fsync_path(ckpt_dir / kind)
    return paths


def _write_rng_state(ckpt_dir: Path) -> Path:
    return _torch_save(capture_rng_state(), ckpt_dir / RNG_FILENAME)


def _write_manifest(ckpt_dir: Path, step: int, keys: Mapping[str, list[str]], files: list[Path]) -> None:
    """Manifest, then the COMPLETE marker, then an fsync of the directory: the last writes of a save."""
    manifest = {
        "format_version": FORMAT_VERSION,
        "layout": LAYOUT,
        "step": step,
        **keys,
        "files": {p.relative_to(ckpt_dir).as_posix(): p.stat().st_size for p in files},
        CHECKSUM_KEY: checksums(ckpt_dir, files),
        "created_unix": time.time(),
        "torch_version": torch.__version__,
    }
    _write_text(ckpt_dir / MANIFEST_FILENAME, json.dumps(manifest, indent=2))
    _write_text(ckpt_dir / COMPLETE_FILENAME, f"{step}\n")
    _fsync_path(ckpt_dir)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished temporary directory to its final name."""
    root, aside = final.parent, None
    if final.exists():
        # os.replace cannot overwrite a non-empty directory, so the old copy moves aside first. Until the
        # new copy is in place, _complete_by_step still finds the aside copy as this step.
        aside = root / f".replaced-{final.name}-{os.getpid()}"
        os.replace(final, aside)
        _fsync_path(root)
    os.replace(tmp, final)
    _fsync_path(root)
    if aside is not None:
        _remove_dir(aside)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".latest.tmp-{os.getpid()}"
    _write_text(tmp, name + "\n")
    os.replace(tmp, root / LATEST_FILENAME)
    _fsync_path(root)


def _remove_dir(path: Path) -> None:
    """Rename to a hidden name before deleting: a crash mid-delete must not leave a half-deleted
    directory that still carries its COMPLETE marker under a loadable name."""
    trash = path.parent / f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}"
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _cleanup_stale(root: Path) -> None:
    """Delete leftovers of crashed saves; restore a moved-aside copy whose replacement never landed."""
    for entry in root.iterdir():
        name = entry.name
        if name.startswith((".tmp-", ".trash-")):
            shutil.rmtree(entry, ignore_errors=True)
        elif name.startswith(".latest.tmp-"):
            entry.unlink(missing_ok=True)
        elif match := _REPLACED_RE.match(name):
            final = root / match.group(1)
            if is_complete_checkpoint(final) or not is_complete_checkpoint(entry):
                shutil.rmtree(entry, ignore_errors=True)
            else:
                if final.exists():
                    _remove_dir(final)
                os.replace(entry, final)
                _fsync_path(root)


def _prune(root: Path, keep_last: int, current_step: int) -> None:
    """Keep the newest ``keep_last`` checkpoints up to ``current_step``; later steps are left alone."""
    complete = _complete_by_step(root)
    older = [step for step in complete if step < current_step]
    for step in older[: max(0, len(older) - (keep_last - 1))]:
        _remove_dir(complete[step])


# --------------------------------------------------------------------------- load


def load_checkpoint(
    path: str | os.PathLike,
    *,
    modules: Mapping[str, nn.Module],
    optimizers: Mapping[str, Optimizer] | None = None,
    schedulers: Mapping[str, LRScheduler] | None = None,
    map_location: str | torch.device = "cpu",
    restore_rng: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Restore modules, optimizers, schedulers and (optionally) RNG states in place.

    Strict: the keys passed must equal the keys saved, and every module's weights must match its
    parameter names and shapes. All of this is checked before anything is modified, and so are the files'
    sizes and checksums unless ``verify=False`` (the caller verified them, e.g. through find_checkpoint).

    Returns:
        The ``trainer_state`` dict given to :func:`save_checkpoint`.
    """
    path = Path(path)
    optimizers, schedulers = dict(optimizers or {}), dict(schedulers or {})
    manifest = read_manifest(path)
    for kind, given in (("modules", modules), ("optimizers", optimizers), ("schedulers", schedulers)):
        _check_keys(path, kind, manifest[kind], given)
    if verify:
        verify_files(path, manifest)
    stored = saved_shapes(path / STATE_DIRNAME)
    for key, module in modules.items():
        _check_module_weights(path, stored, key, module)

    load_state(path / STATE_DIRNAME, modules, optimizers)
    for key, scheduler in schedulers.items():
        scheduler.load_state_dict(_torch_load(path / "scheduler" / f"{key}.pt", map_location))
    if restore_rng:
        restore_rng_state(_torch_load(path / RNG_FILENAME, "cpu"))
    return read_json_file(path / TRAINER_STATE_FILENAME, "the loop's state")


def _torch_load(path: Path, map_location: str | torch.device) -> Any:
    """torch.load with an unreadable file (an older checkpoint without checksums) named in a CheckpointError."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise CheckpointError(
            f"checkpoint file {path} is unreadable ({type(err).__name__}: {str(err)[:200]}); the checkpoint "
            "is damaged: resume from another one"
        ) from None


def _check_keys(path: Path, kind: str, saved: list[str], given: Mapping[str, Any]) -> None:
    for key in given:
        if key not in saved:
            raise CheckpointError(
                f"{kind}[{key!r}]: checkpoint {path} has no state for this key; it holds {kind} {saved}"
            )
    extra = sorted(set(saved) - set(given))
    if extra:
        raise CheckpointError(
            f"checkpoint {path} holds {kind} {extra} that were not passed to load_checkpoint; pass them "
            f"too (the load is strict so that a resumed run continues exactly)"
        )


def _check_module_weights(path: Path, stored: Mapping[str, tuple], key: str, module: nn.Module) -> None:
    """Compare the names and shapes recorded in the checkpoint with the module's (before loading anything)."""
    prefix = f"{key}.model."
    saved = {n[len(prefix) :]: shape for n, shape in stored.items() if n.startswith(prefix)}
    expected = module_shapes(module)
    missing = [n for n in expected if n not in saved]
    unexpected = [n for n in saved if n not in expected]
    mismatched = [
        f"{n} {list(saved[n])} in checkpoint vs {list(expected[n])} in module"
        for n in saved
        if n in expected and saved[n] != expected[n]
    ]
    found = {"missing": missing, "unexpected": unexpected, "shape mismatch": mismatched}
    problems = "; ".join(f"{label}: {items[:5]}" for label, items in found.items() if items)
    if problems:
        raise CheckpointError(
            f"modules[{key!r}]: weights in {path} do not match the module ({problems}); "
            "was the checkpoint written for a different model or config?"
        )


def load_module_weights(
    path: str | os.PathLike, key: str, module: nn.Module, map_location: str = "cpu"
) -> None:
    """Load only `modules[key]`'s weights from a checkpoint (e.g. the policy, for evaluation or export)."""
    path = Path(path)
    manifest = read_manifest(path)
    if key not in manifest["modules"]:
        raise CheckpointError(
            f"checkpoint {path} has no module {key!r}; it holds modules {manifest['modules']}"
        )
    verify_files(path, manifest)
    _check_module_weights(path, saved_shapes(path / STATE_DIRNAME), key, module)
    load_module_state(path / STATE_DIRNAME, key, module)
