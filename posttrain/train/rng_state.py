"""Random generator states of a checkpoint: python, numpy, torch CPU and every CUDA device, so a resumed run
draws the same numbers as one that never stopped."""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from posttrain.config.errors import CheckpointError


def capture_rng_state() -> dict[str, Any]:
    """Generator states of python ``random``, numpy's global generator, torch CPU and every CUDA device.

    Only plain python values and tensors, so ``torch.load(weights_only=True)`` can read it back.
    """
    name, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore generator states captured by :func:`capture_rng_state`.

    CUDA states are skipped with a warning when a different number of devices is visible: restoring
    them onto other devices would not reproduce the saved streams anyway.
    """
    missing = {"python", "numpy", "torch"} - set(state)
    if missing:
        raise CheckpointError(f"RNG state is missing {sorted(missing)}; pass a dict from capture_rng_state()")
    random.setstate(state["python"])
    name, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.int64).astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    cuda_states = state.get("cuda") or []
    if not cuda_states:
        return
    if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
        torch.cuda.set_rng_state_all(cuda_states)
        return
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    warnings.warn(
        f"checkpoint holds RNG states for {len(cuda_states)} CUDA device(s) but {visible} are visible; "
        "CUDA generators were not restored",
        stacklevel=2,
    )
