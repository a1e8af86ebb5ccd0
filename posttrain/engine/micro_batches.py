"""Where the batch plan acts: mini-batches, micro-batches, gradient accumulation, forward-only passes.

One function per loop, shared by every role (actor, critic, reference, reward model):
- `iter_mini_batches`: a step's samples → ppo_epochs × mini-batches, prompt groups kept whole.
- `micro_batch_rows`: a mini-batch → micro-batches, by sample count or by token budget (hard cap).
- `accumulate_and_step`: one optimizer step over a mini-batch with global loss normalisation.
- `forward_in_micro_batches`: a forward-only pass, outputs restored to the original row order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from posttrain.algorithms.aggregation import LossNormalizer
from posttrain.batching.token_budget import plan_token_micro_batches
from posttrain.data.batch import RolloutBatch


@dataclass(frozen=True)
class LossShare:
    """A metric that is one micro-batch's share of a mini-batch total (a loss term built with the global
    normalizer, like the loss itself): :func:`accumulate_and_step` adds the shares up, so the reported value
    does not depend on how the mini-batch was cut. Other metrics are per-micro-batch means and are averaged
    weighted by response tokens."""

    value: torch.Tensor


LossFn = Callable[[RolloutBatch, LossNormalizer], tuple[torch.Tensor, dict[str, torch.Tensor | LossShare]]]


def micro_batch_rows(
    batch: RolloutBatch, micro_batch_size: int | None, max_tokens: int | None
) -> list[list[int]]:
    """Row indices of each micro-batch: fixed `micro_batch_size` rows, or token-budget groups.

    With a token budget no micro-batch holds more than `max_tokens` real tokens (a hard cap; see
    posttrain.batching.token_budget), and the count is the smallest the partitioner finds.
    """
    rows = batch.num_rows
    if max_tokens is not None:
        return plan_token_micro_batches(batch.seq_lens(), max_tokens)
    if micro_batch_size is None:
        raise ValueError("either a micro-batch size or a token budget is required")
    return [list(range(s, min(s + micro_batch_size, rows))) for s in range(0, rows, micro_batch_size)]


def iter_mini_batches(
    batch: RolloutBatch, mini_batch_prompts: int, epochs: int, shuffle: bool, generator: torch.Generator
) -> Iterator[tuple[int, RolloutBatch]]:
    """Yield (epoch, mini-batch) for `epochs` passes; each mini-batch holds whole prompt groups.

    Groups are shuffled between epochs when `shuffle` is on (samples of one prompt stay together, so
    group-relative advantages and seq-mean losses see complete groups, as in verl and SkyRL).
    """
    groups = torch.unique(batch.group_ids, sorted=True)
    rows_of = {int(g): (batch.group_ids == g).nonzero().flatten() for g in groups}
    for epoch in range(epochs):
        order = groups[torch.randperm(len(groups), generator=generator)] if shuffle else groups
        for start in range(0, len(order), mini_batch_prompts):
            chosen = order[start : start + mini_batch_prompts]
            rows = torch.cat([rows_of[int(g)] for g in chosen])
            yield epoch, batch.select(rows)


def accumulate_and_step(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    mini_batch: RolloutBatch,
    micro_rows: list[list[int]],
    loss_fn: LossFn,
    normalizer: LossNormalizer,
    grad_clip: float,
) -> dict[str, float]:
    """Forward/backward every micro-batch, then clip and take one optimizer step.

    `loss_fn` returns each micro-batch's exact share of the mini-batch loss (built with the global
    `normalizer`), so gradients are summed as they are: never divided by the number of micro-batches.
    Metrics are token-weighted means over micro-batches, except :class:`LossShare` metrics and `loss` (the
    mini-batch loss), which are sums of the micro-batch shares.
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
    out = {k: (v if k in shares else v / max(total_tokens, 1.0)) for k, v in sums.items()}
    params = [p for p in module.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
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


@torch.no_grad()
def forward_in_micro_batches(
    fn: Callable[[RolloutBatch], torch.Tensor],
    batch: RolloutBatch,
    micro_batch_size: int | None,
    max_tokens: int | None,
    device: torch.device,
) -> torch.Tensor:
    """Apply `fn` (micro-batch → [b, R] tensor) over the batch; rows come back in the original order."""
    width = batch.response_width
    out: torch.Tensor | None = None
    for rows in micro_batch_rows(batch, micro_batch_size, max_tokens):
        micro = batch.select(rows).trimmed().to(device)
        part = fn(micro).float().cpu()
        if out is None:
            out = torch.zeros((batch.num_rows, width), dtype=part.dtype)
        out[torch.as_tensor(rows), : part.shape[1]] = part
    assert out is not None
    return out
