"""Index planning for a step's samples: mini-batches, each rank's rows, micro-batches. No collectives.

- `iter_mini_batches`: a step's samples (or one rank's share of them) → ppo_epochs × mini-batches, prompt groups
  kept whole, membership drawn over the whole step's groups (the same whatever the number of ranks).
- `rank_micro_batches`: a rank's batch → the rows it processes and its micro-batches, by sample count or by
  token budget (hard cap). Counts may differ between ranks; `posttrain.train.update` evens them out.
- `rank_rows`: a batch split over several ranks (whole prompt groups where possible); `micro_batch_rows`: one
  rank's rows → micro-batches.

Functions take a :class:`RankLayout` (which rank of how many); the collectives that use these plans live in
`posttrain.train.update`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from posttrain.batching.balance import balance_batch
from posttrain.batching.token_budget import (
    minimal_num_micro_batches,
    plan_token_micro_batches,
    plan_token_micro_batches_for_ranks,
)
from posttrain.data.batch import RolloutBatch


@dataclass(frozen=True)
class RankLayout:
    """Which data-parallel rank this is, of how many (the default: one rank does everything).

    Attributes:
        dp_rank, dp_size: this rank's data-parallel index and the number of DP ranks.
        keep_groups: give each rank whole prompt groups where the batch allows it (the prefix grouper computes
            a prompt once per micro-batch, so a group spread over ranks saves less).
        share_ranks: DP ranks that hold the same share of the step's samples (rank-local data,
            `posttrain.parallel.shares`): 1, unless this pass's SP groups are smaller than the share's replicas
            (SP sizes differ between passes); they split the share between them.
    """

    dp_rank: int = 0
    dp_size: int = 1
    keep_groups: bool = False
    share_ranks: int = 1


def rank_rows(batch: RolloutBatch, dp: RankLayout) -> list[list[int]]:
    """Rows of `batch` each of ``dp.dp_size`` ranks processes: equal counts where the rows divide evenly, token
    loads balanced (the same on every rank).

    With ``dp.keep_groups`` whole prompt groups go to each rank when that keeps the counts equal (groups of one
    size, a group count divisible by the ranks); otherwise samples are balanced one by one.
    """
    if dp.dp_size == 1:
        return [list(range(batch.num_rows))]
    if dp.keep_groups:
        shares = whole_group_shares(batch, dp.dp_size)
        if shares is not None:
            return shares
    return balance_batch(batch.seq_lens(), dp.dp_size, equal_size=batch.num_rows % dp.dp_size == 0)


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
    batch: RolloutBatch, dp: RankLayout, micro_batch_size: int | None, max_tokens: int | None
) -> tuple[list[int], list[list[int]]]:
    """This rank's rows of `batch` (its share of the step, or of a mini-batch) and its micro-batches (indices
    into `batch`).

    The rows are the whole batch, unless ``dp.share_ranks`` ranks hold it: they split it (:func:`rank_rows`).
    Ranks may get different micro-batch counts; the update loop evens them out.
    """
    mine = list(range(batch.num_rows))
    if dp.share_ranks > 1 and mine:
        split = RankLayout(dp.dp_rank % dp.share_ranks, dp.share_ranks, dp.keep_groups)
        mine = rank_rows(batch, split)[split.dp_rank]
    if not mine:
        return [], []
    local = batch if len(mine) == batch.num_rows else batch.select(mine)
    if max_tokens is not None and dp.keep_groups:
        micro = group_token_micro_batches(local, [list(range(len(mine)))], max_tokens)[0]
    else:
        micro = micro_batch_rows(local, micro_batch_size, max_tokens)
    return mine, [[mine[i] for i in m] for m in micro]


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
        _group_units(s_lens, [groups[row] for row in share], max_tokens)
        for share, s_lens in zip(shares, share_lens)
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
        [sorted(i for u in micro for i in units[u]) for micro in plan]
        for plan, units in zip(plans, per_rank_units)
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
    batch: RolloutBatch,
    mini_batch_prompts: int,
    epochs: int,
    shuffle: bool,
    generator: torch.Generator,
    step_groups: torch.Tensor | None = None,
) -> Iterator[tuple[int, RolloutBatch]]:
    """Yield (epoch, mini-batch) for `epochs` passes; each mini-batch holds whole prompt groups.

    Groups are shuffled between epochs when `shuffle` is on (samples of one prompt stay together, so
    group-relative advantages and seq-mean losses see complete groups, as in verl and SkyRL).

    ``step_groups``: every group of the step (sorted) when `batch` is one rank's share of it; the shuffle draws
    over them, so mini-batch k holds the same groups whatever the number of ranks, and this rank's mini-batch k
    is its rows of those groups (possibly none). Default: the batch's own groups.
    """
    local = torch.unique(batch.group_ids, sorted=True)
    groups = local if step_groups is None else step_groups
    rows_of = {int(g): (batch.group_ids == g).nonzero().flatten() for g in local}
    none = torch.zeros(0, dtype=torch.long)
    for epoch in range(epochs):
        order = groups[torch.randperm(len(groups), generator=generator)] if shuffle else groups
        for start in range(0, len(order), mini_batch_prompts):
            chosen = order[start : start + mini_batch_prompts]
            rows = torch.cat([rows_of.get(int(g), none) for g in chosen])
            yield epoch, batch.select(rows)
