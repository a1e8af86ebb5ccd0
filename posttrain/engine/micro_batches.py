"""Where the batch plan acts: mini-batches, micro-batches, gradient accumulation, forward-only passes.

One function per loop, shared by every role (actor, critic, reference, reward model):
- `iter_mini_batches`: a step's samples → ppo_epochs × mini-batches, prompt groups kept whole.
- `micro_batch_rows`: a mini-batch → micro-batches, by sample count or by token budget (hard cap).
- `accumulate_and_step`: one optimizer step over a mini-batch with global loss normalisation.
- `forward_in_micro_batches`: a forward-only pass, outputs restored to the original row order.

With several data-parallel ranks (:class:`DataParallel`), every rank holds the whole batch; each
mini-batch (or forward pass) is split over the ranks by token load (`rank_rows`), each rank runs its share
in the same number of micro-batches (collectives line up), and losses use the whole mini-batch's counts, so
results do not depend on the number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from posttrain.algorithms.aggregation import LossNormalizer
from posttrain.batching.balance import balance_batch
from posttrain.batching.token_budget import (
    minimal_num_micro_batches,
    plan_token_micro_batches,
    plan_token_micro_batches_for_ranks,
)
from posttrain.data.batch import RolloutBatch


@dataclass(frozen=True)
class LossShare:
    """A metric that is one micro-batch's share of a mini-batch total (a loss term built with the global
    normalizer, like the loss itself): :func:`accumulate_and_step` adds the shares up, so the reported value
    does not depend on how the mini-batch was cut. Other metrics are per-micro-batch means and are averaged
    weighted by response tokens."""

    value: torch.Tensor


def _no_reduce(values: list[float]) -> list[float]:
    return list(values)


def _gather_one(obj: object) -> list[object]:
    return [obj]


@dataclass(frozen=True)
class DataParallel:
    """How a role's work is spread over ranks (the default: one rank does everything).

    Attributes:
        dp_rank, dp_size: this rank's data-parallel index and the number of DP ranks.
        grad_ranks: ranks the sharded model averages gradients over (all ranks: DP x SP); each rank's loss
            is scaled by it so the average becomes the sum it should be.
        replicas: ranks that process the same data (the SP group size): their metrics count once.
        keep_groups: give each rank whole prompt groups where the batch allows it (the prefix grouper computes
            a prompt once per micro-batch, so a group spread over ranks saves less).
        all_reduce_sum: element-wise sum of a list of floats over all ranks.
        all_gather: every rank's (picklable) object, in rank order.
    """

    dp_rank: int = 0
    dp_size: int = 1
    grad_ranks: int = 1
    replicas: int = 1
    keep_groups: bool = False
    all_reduce_sum: Callable[[list[float]], list[float]] = field(default=_no_reduce, compare=False)
    all_gather: Callable[[object], list[object]] = field(default=_gather_one, compare=False)


SINGLE_RANK = DataParallel()


def rank_rows(batch: RolloutBatch, dp: DataParallel) -> list[list[int]]:
    """Rows of `batch` each DP rank processes: equal counts, token loads balanced (same on every rank).

    With ``dp.keep_groups`` whole prompt groups go to each rank when that keeps the counts equal (groups of one
    size, a group count divisible by the ranks); otherwise samples are balanced one by one.
    """
    if dp.dp_size == 1:
        return [list(range(batch.num_rows))]
    if dp.keep_groups:
        shares = whole_group_shares(batch, dp.dp_size)
        if shares is not None:
            return shares
    return balance_batch(batch.seq_lens(), dp.dp_size, equal_size=True)


def whole_group_shares(batch: RolloutBatch, ranks: int) -> list[list[int]] | None:
    """Whole prompt groups per rank, equal sample counts, token loads balanced; None when groups differ in
    size or their count is not a multiple of ``ranks``. Rows are ascending per rank (a mini-batch's groups
    are contiguous, so they stay contiguous)."""
    members: dict[int, list[int]] = {}
    for row, group in enumerate(batch.group_ids.tolist()):
        members.setdefault(group, []).append(row)
    groups = list(members.values())
    if len({len(g) for g in groups}) != 1 or len(groups) % ranks:
        return None
    lens = batch.seq_lens()
    parts = balance_batch([sum(lens[i] for i in g) for g in groups], ranks, equal_size=True)
    return [sorted(row for g in part for row in groups[g]) for part in parts]


def rank_micro_batches(
    batch: RolloutBatch, dp: DataParallel, micro_batch_size: int | None, max_tokens: int | None
) -> tuple[list[int], list[list[int]]]:
    """This rank's rows of `batch` and its micro-batches (indices into `batch`).

    With a token budget every rank gets the same number of micro-batches (the largest minimal count), so
    the collectives of a sharded model line up.
    """
    shares = rank_rows(batch, dp)
    mine = shares[dp.dp_rank]
    if max_tokens is not None and dp.keep_groups:
        grouped = group_token_micro_batches(batch, shares, max_tokens)
        return mine, [[mine[i] for i in micro] for micro in grouped[dp.dp_rank]]
    if max_tokens is not None and dp.dp_size > 1:
        lens = batch.seq_lens()
        plans = plan_token_micro_batches_for_ranks([[lens[i] for i in s] for s in shares], max_tokens)
        local = plans[dp.dp_rank]
    else:
        local = micro_batch_rows(batch.select(mine), micro_batch_size, max_tokens)
    return mine, [[mine[i] for i in micro] for micro in local]


def group_token_micro_batches(
    batch: RolloutBatch, shares: list[list[int]], max_tokens: int
) -> list[list[list[int]]]:
    """Token-budget micro-batches for every rank's share that keep a prompt's samples together (for the prefix
    grouper), with the same count on every rank; indices into each share.

    Units are a prompt's samples in the share, cut into consecutive chunks of at most ``max_tokens`` plain
    tokens; the units are bin-packed under the same hard cap on plain tokens as sample-by-sample planning, so
    the budget means the same thing (and bounds the fewer tokens a grouped micro-batch computes). A rank with
    fewer units than the common micro-batch count has its largest units halved until it has enough.
    """
    lens, groups = batch.seq_lens(), batch.group_ids.tolist()
    share_lens = [[lens[row] for row in share] for share in shares]
    per_rank_units = [
        _group_units(s_lens, [groups[row] for row in share], max_tokens) for share, s_lens in zip(shares, share_lens)
    ]
    costs = [[sum(s_lens[i] for i in u) for u in units] for s_lens, units in zip(share_lens, per_rank_units)]
    common = max(minimal_num_micro_batches(c, max_tokens) for c in costs)
    for units in per_rank_units:
        while len(units) < common and max(map(len, units)) > 1:
            big = max(range(len(units)), key=lambda u: len(units[u]))
            half = len(units[big]) // 2
            units[big : big + 1] = [units[big][:half], units[big][half:]]
    costs = [[sum(s_lens[i] for i in u) for u in units] for s_lens, units in zip(share_lens, per_rank_units)]
    plans = plan_token_micro_batches_for_ranks(costs, max_tokens, min_num_micro_batches=common)
    return [
        [sorted(i for u in micro for i in units[u]) for micro in plan] for plan, units in zip(plans, per_rank_units)
    ]


def _group_units(lens: list[int], groups: list[int], max_tokens: int) -> list[list[int]]:
    """Positions grouped by prompt, each group cut into consecutive chunks of at most ``max_tokens`` tokens."""
    units: list[list[int]] = []
    open_chunk: dict[int, tuple[list[int], int]] = {}  # group -> (its last chunk, that chunk's tokens)
    for pos, (length, group) in enumerate(zip(lens, groups)):
        chunk, load = open_chunk.get(group, (None, 0))
        if chunk is None or load + length > max_tokens:
            chunk, load = [], 0
            units.append(chunk)
        chunk.append(pos)
        open_chunk[group] = (chunk, load + length)
    return units


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
