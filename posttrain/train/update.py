"""The loops that run the batch plan: gradient accumulation over micro-batches, forward-only passes, and a
role's whole update (ppo_epochs × mini-batches × micro-batches).

With several data-parallel ranks (:class:`DataParallel`) each rank holds its share of the step (whole prompt
groups, `posttrain.parallel.shares`) and computes on its own rows only: nothing about the samples is gathered.
Mini-batch k holds the same groups whatever the number of ranks; each rank trains its rows of it. Losses use
the whole mini-batch's counts (summed over ranks), so results do not depend on the number of ranks. Ranks may
hold different numbers of micro-batches; every rank makes the largest count of forward (and backward) calls,
the extra ones on one of its rows with their result dropped (a loss times 0), so a sharded model's collectives
line up.
"""

from __future__ import annotations

import dataclasses
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
    even_out: EvenOutCalls | None = None,
) -> dict[str, float]:
    """Forward/backward every micro-batch, then clip and take one optimizer step.

    `loss_fn` returns each micro-batch's exact share of the mini-batch loss (built with the global
    `normalizer`), so gradients are summed as they are: never divided by the number of micro-batches.
    Metrics are token-weighted means over micro-batches, except :class:`LossShare` metrics and `loss` (the
    mini-batch loss), which are sums of the micro-batch shares. With several ranks, `micro_rows` are this
    rank's, ``even_out`` adds the calls that even out the ranks' counts, and the metrics are reduced over all ranks.
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
        _add_metrics(sums, shares, loss, metrics, tokens)
    calls = len(micro_rows)
    if even_out is not None:
        calls += even_out.run_backward(loss_fn, normalizer, sums, shares, device)
    out = _reduce_metrics(sums, shares, total_tokens, normalizer, dp)
    _clip_and_step(module, optimizer, scheduler, grad_clip, out)
    out["micro_batches"] = float(calls)
    return out


def _add_metrics(
    sums: dict[str, float], shares: set[str], loss: torch.Tensor, metrics: dict, tokens: float | None
) -> None:
    """Add one micro-batch's loss and metrics to the sums (``tokens`` None: an even-out call, names only)."""
    counted = tokens is not None
    sums["loss"] = sums.get("loss", 0.0) + (float(loss.detach()) if counted else 0.0)
    for name, value in metrics.items():
        if isinstance(value, LossShare):
            shares.add(name)
            sums[name] = sums.get(name, 0.0) + (float(value.value) if counted else 0.0)
        else:
            sums[name] = sums.get(name, 0.0) + (float(value) * tokens if counted else 0.0)


def _clip_and_step(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    grad_clip: float,
    out: dict[str, float],
) -> None:
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


@dataclass(frozen=True)
class EvenOutCalls:
    """Calls that even out the ranks' micro-batch counts: ``calls`` forwards (and backwards) of ``row`` (one of
    this rank's samples) whose results are dropped."""

    row: RolloutBatch
    calls: int

    def run_backward(
        self, loss_fn: LossFn, normalizer: LossNormalizer, sums: dict, shares: set[str], device
    ) -> int:
        """An update's extra calls: each loss times 0 (no gradient); metric names recorded, values not."""
        micro = self.row.trimmed().to(device)
        for _ in range(self.calls):
            loss, metrics = loss_fn(micro, normalizer)
            (loss * 0.0).backward()
            _add_metrics(sums, shares, loss, metrics, None)
        return self.calls

    def run_forward(self, fn: Callable[[RolloutBatch], torch.Tensor], device: torch.device) -> None:
        """A forward-only pass's extra calls (results dropped)."""
        micro = self.row.trimmed().to(device)
        for _ in range(self.calls):
            fn(micro)


def even_out_calls(batch: RolloutBatch, calls: int, dp: DataParallel) -> EvenOutCalls | None:
    """The :class:`EvenOutCalls` that brings this rank's ``calls`` to the most any rank makes (one collective; None,
    and no collective, on a single rank)."""
    if dp.grad_ranks == 1:
        return None
    most = int(dp.all_reduce_max([float(calls)])[0])
    return EvenOutCalls(batch.select([0]), most - calls)


def _reduce_metrics(
    sums: dict[str, float], shares: set[str], tokens: float, normalizer: LossNormalizer, dp: DataParallel
) -> dict[str, float]:
    """Per-rank metric sums → mini-batch metrics. Loss shares carry the gradient-averaging scale
    (normalizer.dp_size), removed here; SP replicas computed the same shares, counted once."""
    if dp.grad_ranks == 1:
        return {k: (v if k in shares else v / max(tokens, 1.0)) for k, v in sums.items()}
    names = sorted(
        sums
    )  # every rank computes the same metrics (a rank without rows: its even-out calls' names)
    reduced = dp.all_reduce_sum([sums[k] for k in names] + [tokens])
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
    """Apply `fn` (micro-batch → [b, R] tensor, or [b, R, k] for k values per token) over the batch; rows
    come back in the original order.

    With several ranks `batch` is this rank's share and only its rows are computed (every rank holding the
    share computes all of them: nothing is gathered); the ranks make the same number of calls.
    """
    width = batch.response_width
    whole = dataclasses.replace(dp, share_ranks=1)
    _, micro_rows = rank_micro_batches(batch, whole, micro_batch_size, max_tokens)
    out = None
    for rows in micro_rows:
        micro = batch.select(rows).trimmed().to(device)
        part = fn(micro).float().cpu()
        if out is None:  # the first part tells the trailing shape
            out = torch.zeros((batch.num_rows, width, *part.shape[2:]), dtype=torch.float32)
        out[torch.as_tensor(rows), : part.shape[1]] = part
    if out is None:
        out = torch.zeros((batch.num_rows, width), dtype=torch.float32)
    extra = even_out_calls(batch, len(micro_rows), dp)
    if extra is not None:
        extra.run_forward(fn, device)
    return out


def update_mini_batch(
    trainable: Trainable,
    mini: RolloutBatch,
    loss_fn: LossFn,
    *,
    micro_batch_size: int | None,
    max_tokens: int | None,
    norm_constant: float,
    dp: DataParallel = SINGLE_RANK,
    spare_rows: RolloutBatch | None = None,
) -> dict[str, float]:
    """One optimizer step on a mini-batch: its loss denominators (over every rank), this rank's micro-batches
    (``micro_batch_size`` rows each, or a ``max_tokens`` budget), then :func:`accumulate_and_step`.

    The RL update (:func:`run_update`) and SFT both take their steps here. ``spare_rows``: the batch whose first
    row the calls that even out the ranks' micro-batch counts use (this rank's share; default ``mini``).
    """
    normalizer = mini_batch_normalizer(mini, norm_constant, dp)
    _, rows = rank_micro_batches(mini, dp, micro_batch_size, max_tokens)
    return accumulate_and_step(
        trainable.module,
        trainable.optimizer,
        trainable.scheduler,
        mini,
        rows,
        loss_fn,
        normalizer,
        trainable.grad_clip,
        dp,
        even_out_calls(mini if spare_rows is None else spare_rows, len(rows), dp),
    )


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

    `batch`: this rank's share of the step (the whole step on one rank). Every rank draws the same mini-batches
    (the same generator, over ``batch.step_groups``); each trains its rows of every mini-batch.
    """
    if batch.step_groups is None and dp.dp_size > dp.share_ranks:
        raise ValueError("with several data shares, run_update takes this rank's share (parallel.shares)")
    trainable.module.train()
    per_step: list[dict[str, float]] = []
    budget = plan.max_token_len_per_rank if plan.use_dynamic_bsz else None
    for _epoch, mini in iter_mini_batches(
        batch, plan.mini_batch_prompts, plan.ppo_epochs, shuffle, generator, batch.step_groups
    ):
        per_step.append(
            update_mini_batch(
                trainable,
                mini,
                loss_fn,
                micro_batch_size=plan.micro_batch_size_per_rank,
                max_tokens=budget,
                norm_constant=norm_constant,
                dp=dp,
                spare_rows=batch,
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


def mini_batch_normalizer(mini: RolloutBatch, norm_constant: float, dp: DataParallel) -> LossNormalizer:
    """The loss denominators of a mini-batch: its valid tokens and sequences on every rank (one sum over ranks;
    the ranks holding one share count it once), with the gradient-averaging scale ``dp.grad_ranks``."""
    local = LossNormalizer.from_mask(mini.response_mask, norm_constant, dp_size=dp.grad_ranks)
    if dp.grad_ranks == 1:
        return local
    tokens, sequences = dp.share_sum([local.num_tokens, local.num_sequences])
    return dataclasses.replace(local, num_tokens=tokens, num_sequences=sequences)
