"""Activation offload for the training forward (``actor.enable_activation_offload``; CUDA only)."""

from __future__ import annotations

import torch


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """torch's ``save_on_cpu(pin_memory=True)``, except that a saved tensor that is not contiguous stays on the
    GPU.

    Why: ``save_on_cpu`` brings a tensor back contiguous, and some kernels need the strides they saved. sdpa's
    memory-efficient backward reads its attention mask as a view of a buffer padded to a multiple of 4 columns;
    returned contiguous (stride 14 for 14 keys) it fails with "attn_bias is not correctly aligned" (seen on an
    H100 with torch 2.11). Such views are small (masks, slices); the activations that fill memory are contiguous.
    """

    def __init__(self) -> None:
        super().__init__(_pack_to_cpu, _unpack_from_cpu)


def _pack_to_cpu(tensor: torch.Tensor):
    if tensor.device.type != "cuda" or not tensor.is_contiguous():
        return tensor
    saved = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
    saved.copy_(tensor)
    return tensor.device, saved


def _unpack_from_cpu(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    device, saved = packed
    return saved.to(device, non_blocking=True)
