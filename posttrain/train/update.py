"""The loops that run the batch plan: gradient accumulation over micro-batches, forward-only passes, and a
role's whole update (ppo_epochs × mini-batches × micro-batches).

With several data-parallel ranks (:class:`DataParallel`), each mini-batch (or forward pass) is split over the
ranks by `posttrain.batching.micro`, each rank runs its share in the same number of micro-batches (collectives
line up), and losses use the whole mini-batch's counts, so results do not depend on the number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from posttrain.algorithms.aggregation import LossNormalizer
from posttrain.batching.micro import iter_mini_batches, rank_micro_batches
from posttrain.config.plan import UpdatePlan
from posttrain.data.batch import RolloutBatch
from posttrain.parallel.data_parallel import SINGLE_RANK, DataParallel
from posttrain.train.trainable import Trainable


@dataclass(frozen=True)
class LossShare:
    """A metric that is one micro-batch's share of a mini-batch total (a loss term built with the global
    normalizer, like the loss itself): :func:`accumulate_and_step` adds the shares up, so the reported value
    does not depend on how the mini-batch was cut. Other metrics are per-micro-batch means and are averaged
    weighted by response tokens."""

    value: torch.Tensor


LossFn = Callable[[RolloutBatch, LossNormalizer], tuple[torch.Tensor, dict[str, torch.Tensor | LossShare]]]


def accumulate_and_step(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    mini_batch: RolloutBatch,
    micro_rows: list[list[int]],
    loss_fn: LossFn,
    normalizer: LossNormalizer,
    grad_clip: float,
    dp: DataParallel = SINGLE_RANK,
) -> dict[str, float]:
    """Forward/backward every micro-batch, then clip and take one optimizer step.

    `loss_fn` returns each micro-batch's exact share of the mini-batch loss (built with the global
    `normalizer`), so gradients are summed as they are: never divided by the number of micro-batches.
    Metrics are token-weighted means over micro-batches, except :class:`LossShare` metrics and `loss` (the
    mini-batch loss), which are sums of the micro-batch shares. With several ranks, `micro_rows` are this
    rank's and the metrics are reduced over all ranks.
    """
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    shares = {"loss"}
    total_tokens = 0.0
    device = next(module.parameters()).device
    for rows in micro_rows:
        micro = mini_batch.select(rows).trimmed().to(device)
        loss, metrics = loss_fn(micro, normalizer)
        loss.backward()
        tokens = float(micro.response_mask.sum())
        total_tokens += tokens
        sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
        for name, value in metrics.items():
            if isinstance(value, LossShare):
                shares.add(name)
                sums[name] = sums.get(name, 0.0) + float(value.value)
            else:
                sums[name] = sums.get(name, 0.0) + float(value) * tokens
    out = _reduce_metrics(sums, shares, total_tokens, normalizer, dp)
    params = [p for p in module.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # sharded parameters: the norm is a DTensor (already global)
        norm = norm.full_tensor()
    out["grad_norm"] = float(norm)
    if torch.isfinite(norm):
        optimizer.step()
    else:
        # A non-finite gradient would poison the weights and the optimizer state: skip this step.
        out["skipped_steps"] = 1.0
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    out["micro_batches"] = float(len(micro_rows))
    return out


def _reduce_metrics(
    sums: dict[str, float], shares: set[str], tokens: float, normalizer: LossNormalizer, dp: DataParallel
) -> dict[str, float]:
    """Per-rank metric sums → mini-batch metrics. Loss shares carry the gradient-averaging scale
    (normalizer.dp_size), removed here; SP replicas computed the same shares, counted once."""
    if dp.dp_size * dp.replicas == 1:
        return {k: (v if k in shares else v / max(tokens, 1.0)) for k, v in sums.items()}
    names = sorted(dp.all_gather(sorted(sums))[0])  # rank 0's names: every rank computes the same metrics
    reduced = dp.all_reduce_sum([sums.get(k, 0.0) for k in names] + [tokens])
    total_tokens = max(reduced[-1], 1.0)
    out = {}
    for k, v in zip(names, reduced[:-1]):
        out[k] = v / (normalizer.dp_size * dp.replicas) if k in shares else v / total_tokens
    return out


@torch.no_grad()
def forward_in_micro_batches(
    fn: Callable[[RolloutBatch], torch.Tensor],
    batch: RolloutBatch,
    micro_batch_size: int | None,
    max_tokens: int | None,
    device: torch.device,
    dp: DataParallel = SINGLE_RANK,
) -> torch.Tensor:
    """Apply `fn` (micro-batch → [b, R] tensor) over the batch; rows come back in the original order.

    With several DP ranks each computes its share and every rank receives the whole result.
    """
    width = batch.response_width
    mine, micro_rows = rank_micro_batches(batch, dp, micro_batch_size, max_tokens)
    out = torch.zeros((batch.num_rows, width), dtype=torch.float32)
    for rows in micro_rows:
        micro = batch.select(rows).trimmed().to(device)
        part = fn(micro).float().cpu()
        out[torch.as_tensor(rows), : part.shape[1]] = part
    if dp.dp_size > 1:
        # Every SP replica holds the same rows; take one copy per DP rank.
        gathered = dp.all_gather((mine, out[torch.as_tensor(mine)]))
        for rows, values in gathered[:: dp.replicas]:
            out[torch.as_tensor(rows)] = values
    return out


def run_update(
    trainable: Trainable,
    batch: RolloutBatch,
    plan: UpdatePlan,
    loss_fn: LossFn,
    *,
    shuffle: bool,
    norm_constant: float,
    generator: torch.Generator,
    prefix: str,
    dp: DataParallel = SINGLE_RANK,
) -> dict[str, float]:
    """ppo_epochs × mini-batches × micro-batches for one role; returns metrics averaged over steps.

    Every rank sees the same mini-batches (same generator); each runs its share of every mini-batch.
    """
    trainable.module.train()
    per_step: list[dict[str, float]] = []
    budget = plan.max_token_len_per_rank if plan.use_dynamic_bsz else None
    for _epoch, mini in iter_mini_batches(
        batch, plan.mini_batch_prompts, plan.ppo_epochs, shuffle, generator
    ):
        normalizer = LossNormalizer.from_mask(mini.response_mask, norm_constant, dp_size=dp.grad_ranks)
        _, rows = rank_micro_batches(mini, dp, plan.micro_batch_size_per_rank, budget)
        per_step.append(
            accumulate_and_step(
                trainable.module,
                trainable.optimizer,
                trainable.scheduler,
                mini,
                rows,
                loss_fn,
                normalizer,
                trainable.grad_clip,
                dp,
            )
        )
    keys = {k for m in per_step for k in m}
    out = {
        k if "/" in k else f"{prefix}/{k}": sum(m.get(k, 0.0) for m in per_step) / len(per_step) for k in keys
    }
    # Skips are counted, not averaged: the loop's guard compares them with the number of optimizer steps.
    out[f"{prefix}/skipped_steps"] = sum(m.get("skipped_steps", 0.0) for m in per_step)
    out[f"{prefix}/lr"] = trainable.lr
    out[f"{prefix}/optimizer_steps"] = float(len(per_step))
    return out
