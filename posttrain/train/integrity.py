"""Checkpoint integrity: a sha256 per file in the manifest, checked before anything is loaded.

A size check catches truncated copies; a checksum also catches bytes changed in place (a bad disk, a
partial overwrite, a copy tool that zero-fills). Every problem is a CheckpointError naming the file, so a
damaged checkpoint is reported, or skipped by ``resume=auto``, instead of loading garbage or dying in a
deserialiser's traceback.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttrain.config.errors import CheckpointError

_CHUNK = 1 << 20  # stream files in 1 MiB pieces: a shard may be larger than memory
CHECKSUM_KEY = "sha256"


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checksums(root: Path, files: list[Path]) -> dict[str, str]:
    """{path relative to ``root``: sha256} for the manifest."""
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in files}


def read_json_file(path: Path, what: str) -> Any:
    """Parse a checkpoint's JSON file; garbage is a CheckpointError naming it, not a JSONDecodeError."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint file {path} ({what}) is unreadable: {type(err).__name__}: {err}. The checkpoint is "
            "damaged; resume from another one (trainer.resume=auto skips damaged checkpoints, or name one with "
            "trainer.resume=<path>) or trainer.resume=disable to start fresh"
        ) from None


def verify_files(ckpt: Path, manifest: Mapping[str, Any]) -> None:
    """Every file the manifest lists exists with its recorded size and (when recorded) sha256."""
    sizes = manifest.get("files")
    sums = manifest.get(CHECKSUM_KEY) or {}
    if not isinstance(sizes, Mapping) or not isinstance(sums, Mapping):
        raise CheckpointError(
            f"checkpoint file {ckpt / 'manifest.json'} is damaged: 'files' (and '{CHECKSUM_KEY}') must be "
            "mappings of file name to size (and checksum); resume from another checkpoint"
        )
    for rel, size in sizes.items():
        file = ckpt / rel
        if not file.is_file() or file.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint {ckpt} is damaged: {file} is missing or not {size} bytes as recorded in its "
                "manifest; resume from another checkpoint (trainer.resume=auto skips damaged ones)"
            )
        expected = sums.get(rel)
        if expected is not None and sha256_file(file) != expected:
            raise CheckpointError(
                f"checkpoint {ckpt} is damaged: {file} does not match the sha256 recorded in its manifest "
                "(its bytes changed after the save); resume from another checkpoint (trainer.resume=auto "
                "skips damaged ones)"
            )


def check_safetensors_file(path: Path) -> None:
    """A safetensors file's header parses and its size covers every tensor it declares.

    Catches a truncated or overwritten ``model.safetensors`` with a message naming it, before the loader
    fails deep inside a library with "Error while deserializing header".
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"header of {header_len} bytes in a {size}-byte file")
            header = json.loads(f.read(header_len))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (struct.error, ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"model file {path} is damaged or not a safetensors file ({type(err).__name__}: {err}); copy or "
            "export the model again"
        ) from None
    needed = 8 + header_len + max(ends, default=0)
    if size < needed:
        raise CheckpointError(
            f"model file {path} is truncated: {size} bytes, its header declares {needed}; copy or export the "
            "model again"
        )


def check_model_dir(path: Path) -> None:
    """Check every safetensors file of a Hugging Face model directory (see check_safetensors_file)."""
    for file in sorted(path.glob("*.safetensors")):
        check_safetensors_file(file)
