"""The C allocator's policy for training on CPU (``trainer.tune_malloc``).

A training step allocates and frees the same large tensors (activations, logits, gradients) over and over.
glibc's malloc serves big requests with fresh ``mmap`` pages and returns freed memory at the top of its heap to
the operating system, so every step faults the same pages in again and the kernel zeroes each one: a tiny
model's 8x8x128 GRPO step took 30k-160k page faults. Keeping freed memory in the process (no ``mmap`` for large
blocks, no trimming of the heap) lets the next step reuse it. The process then holds on to its peak memory
until it exits, as PyTorch's GPU caching allocator does, which is what a training job needs anyway.

It is process-wide policy, so only the commands that train (``posttrain train``, ``sft``, ``rm``) apply it, and
only when they train on the CPU: on a GPU the large tensors live in the CUDA allocator. It never changes a
number, only where the memory comes from.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

import torch

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

# Keep up to this much free memory at the top of the heap rather than returning it (mallopt takes an int: 2 GiB
# is its largest value, far above a CPU step's churn).
_TRIM_THRESHOLD_BYTES = 2**31 - 1


def keep_freed_memory_for_cpu_training(enabled: bool, device: torch.device) -> str:
    """Apply the policy when ``enabled`` and training runs on the CPU; returns what was done, in words."""
    if not enabled:
        return "glibc malloc defaults (trainer.tune_malloc=false)"
    if device.type != "cpu":
        return f"glibc malloc defaults (training on {device.type})"
    libc = _glibc()
    if libc is None:
        return "system allocator defaults (not Linux with glibc)"
    # mallopt returns 1 on success. M_MMAP_MAX=0 serves every block from the heap (the mmap threshold cannot be
    # raised past 32 MiB, below a large step's tensors); the trim threshold keeps freed pages mapped.
    ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) == 1
    return "freed memory kept for reuse (glibc mallopt)" if ok else "glibc malloc defaults (mallopt refused)"


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc
