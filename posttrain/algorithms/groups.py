"""Shared pieces of the outcome (group) advantage estimators: input checks, group ids and group statistics.

Kept apart from the estimators so that every estimator module can use them and the registry in
:mod:`posttrain.algorithms.advantages` can import every estimator module without an import cycle.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

GroupIds = Sequence[Hashable] | torch.Tensor | None
"""Per-sample group ids: a list, tuple, numpy array or tensor of hashables (e.g. prompt uids)."""


def float_mask(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``response_mask`` in the rewards' dtype, after checking both are ``[B, T]`` of the same shape."""
    if token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must be [B, T], got shape {tuple(token_level_rewards.shape)}")
    if response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} != token_level_rewards shape "
            f"{tuple(token_level_rewards.shape)}"
        )
    return response_mask.to(token_level_rewards.dtype)


def group_index(group_ids: GroupIds, batch_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Map arbitrary per-sample group ids to contiguous ``[B]`` long indices ``0..G-1`` (first-seen order)."""
    if group_ids is None:
        raise ValueError(
            "group_ids is required by group-based estimators (grpo, drgrpo, rloo, ...); got None"
        )
    ids = group_ids.reshape(-1).tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != batch_size:
        raise ValueError(f"group_ids has {len(ids)} entries but the batch has {batch_size} rows")
    seen: dict[Hashable, int] = {}
    index = [seen.setdefault(gid, len(seen)) for gid in ids]
    return torch.tensor(index, dtype=torch.long, device=device)


def num_groups(index: torch.Tensor) -> int:
    """How many groups a contiguous index from :func:`group_index` names."""
    return int(index.max().item()) + 1 if index.numel() else 0


def group_sum(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-group sum ``[G]`` of the per-sample ``values [B]``."""
    zeros = torch.zeros(num_groups(index), dtype=values.dtype, device=values.device)
    return zeros.index_add(0, index, values)


def group_stats(scores: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, unbiased std and group size, broadcast back to ``[B]``.

    A group of one sample gets mean 0 and std 1 (verl's convention), so its GRPO advantage is
    ``score / (1 + epsilon)`` rather than 0.
    """
    count = group_sum(torch.ones_like(scores), index)
    mean = group_sum(scores, index) / count
    sq_dev = group_sum((scores - mean[index]) ** 2, index)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))
    single = count <= 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[index], std[index], count[index]
