"""Counting what the trainer sends over torch.distributed from Python (tests/parallel/workers.py collective_bytes).

Every call of ``all_gather_object``, ``broadcast_object_list``, ``all_reduce``, ``all_gather``, ``broadcast``
and ``all_gather_into_tensor`` made by posttrain code is counted at the torch.distributed module level: pickled
objects by their pickle size, tensors by ``numel * element_size`` (what this rank contributes). Nested calls
(``all_gather_object`` gathers sizes, then bytes) count once, at the outermost call. FSDP2 moves parameters and
gradients with ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` from torch's own code; those calls are not
the trainer's data and are left out (the caller must be a posttrain module).
"""

from __future__ import annotations

import contextlib
import pickle
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

NAMES = (
    "all_gather_object",
    "broadcast_object_list",
    "all_reduce",
    "all_gather",
    "broadcast",
    "all_gather_into_tensor",
)


def _payload(name: str, args: tuple, kwargs: dict) -> int:
    if name == "all_gather_object":
        return len(pickle.dumps(args[1] if len(args) > 1 else kwargs["obj"]))
    if name == "broadcast_object_list":
        return len(pickle.dumps(args[0] if args else kwargs["object_list"]))
    tensor = args[1] if name in ("all_gather", "all_gather_into_tensor") else args[0]
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


# Modules whose functions only wrap a collective: the caller named is the code that called them.
WRAPPERS = ("posttrain.parallel.runtime", "posttrain.parallel.data_parallel", "posttrain.parallel.shares")


def _posttrain_caller() -> str | None:
    """``module:function`` of the innermost posttrain frame on the stack outside :data:`WRAPPERS`, or None (a
    call from torch itself: FSDP2, DTensor)."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("posttrain.") and module not in WRAPPERS:
            return f"{module}:{frame.f_code.co_name}"
        if module.startswith("torch.distributed.fsdp") or module.startswith("torch.distributed.tensor"):
            return None
        frame = frame.f_back
    return None


@contextlib.contextmanager
def count_collective_bytes() -> Iterator[dict[str, int]]:
    """Patch the collectives for the duration; yields {caller: bytes sent} (filled as the calls happen)."""
    counts: dict[str, int] = {}
    depth = [0]
    originals = {name: getattr(dist, name) for name in NAMES}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            if depth[0] == 0:
                caller = _posttrain_caller()
                if caller is not None:
                    counts[caller] = counts.get(caller, 0) + _payload(name, args, kwargs)
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
