"""Rank-local data: which share of a step's samples this rank holds, and what crosses ranks about them.

After the rollout every data-parallel rank keeps whole prompt groups: share ``d`` of ``D`` holds the contiguous
prompts ``shard_bounds(P, d, D)`` and all their samples, through the forward passes and the update. The ranks
``[d * S, (d + 1) * S)`` hold share ``d`` (``S``, the share's *replicas*, is the least common multiple of the
passes' Ulysses SP sizes, so every SP group sees one share; 1 without SP). Nothing else about the samples is
ever gathered; what must be global crosses ranks as float64 tensors:

- :meth:`DataShare.total`: sums over the shares (a whitening moment, a count, a KL sum); replicas hold the same
  share, so only the first rank of each share (the *leader*) contributes;
- :meth:`DataShare.maximum`: element-wise maxima (minima as maxima of negated values);
- :meth:`DataShare.reduce`: a phase's metrics (:class:`ShareMetrics`), weighted means, sums, maxima, minima.

With one share (a world of one, or one SP group) every function returns its input: no collective, no new cost.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from posttrain.data.batch import RolloutBatch
from posttrain.parallel.runtime import DistContext, shard_bounds
from posttrain.parallel.ulysses import new_sequence_parallel_group

MEAN, SUM, MAX, MIN = "mean", "sum", "max", "min"


def _no_reduce(values: list[float]) -> list[float]:
    return list(values)


def _gather_one(obj: object) -> list[object]:
    return [obj]


@dataclass
class ShareMetrics:
    """Metrics of this rank's share and how each one combines over shares.

    ``how``: ``mean`` (weighted by ``weight``: the samples, rows or tokens it averages), ``sum``, ``max`` or
    ``min``. ``own``: the value measures this rank's own work (e.g. the samples it scored before the replicas of
    its share joined theirs), so every rank contributes, not the share's leader alone.
    """

    values: dict[str, float] = field(default_factory=dict)
    how: dict[str, str] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    own: set[str] = field(default_factory=set)

    def add(
        self, metrics: Mapping[str, float], how: str = MEAN, weight: float = 1.0, own: bool = False
    ) -> None:
        for name, value in metrics.items():
            self.values[name] = float(value)
            self.how[name] = how
            self.weights[name] = float(weight)
            if own:
                self.own.add(name)


@dataclass(frozen=True)
class DataShare:
    """This rank's share of a step (the default: one share, the whole step).

    Attributes:
        index, count: which share this rank holds, of how many (``d`` and ``D``).
        replicas: ranks holding this same share (``S``); ``leader``: this rank is the first of them.
        all_reduce_sum, all_reduce_max: element-wise over all ranks (float64 tensors).
        gather_replicas: every replica's (picklable) object, in rank order: joins what the replicas
            generated, each a part of the share.
    """

    index: int = 0
    count: int = 1
    replicas: int = 1
    leader: bool = True
    all_reduce_sum: Callable[[list[float]], list[float]] = field(default=_no_reduce, compare=False)
    all_reduce_max: Callable[[list[float]], list[float]] = field(default=_no_reduce, compare=False)
    gather_replicas: Callable[[object], list[object]] = field(default=_gather_one, compare=False)

    @property
    def distributed(self) -> bool:
        """Whether other ranks hold other shares (only then does anything cross ranks)."""
        return self.count > 1

    def bounds(self, num_groups: int) -> tuple[int, int]:
        """[lo, hi) of this share's groups among the step's ``num_groups`` (prompts, in order)."""
        return shard_bounds(num_groups, self.index, self.count)

    def total(self, values: list[float]) -> list[float]:
        """Element-wise sums over the shares of per-share values (every replica passes the same values)."""
        if not self.distributed:
            return list(values)
        return self.all_reduce_sum([v if self.leader else 0.0 for v in values])

    def maximum(self, values: list[float]) -> list[float]:
        """Element-wise maxima over the shares."""
        return self.all_reduce_max(values) if self.distributed else list(values)

    def batch_sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A tensor of this share's partial sums → the whole step's (the algorithms' ``batch_sum``)."""
        summed = self.total(partial.reshape(-1).tolist())
        return torch.tensor(summed, dtype=partial.dtype, device=partial.device).reshape(partial.shape)

    def reduce(self, metrics: ShareMetrics) -> dict[str, float]:
        """The step's metrics from every share's :class:`ShareMetrics`: one sum and one max over ranks."""
        if not self.distributed:
            return dict(metrics.values)
        names = sorted(metrics.values)
        added = [k for k in names if metrics.how[k] in (MEAN, SUM)]
        extreme = [k for k in names if metrics.how[k] in (MAX, MIN)]
        out = self._sums_and_means(metrics, added) if added else {}
        if extreme:
            signs = [1.0 if metrics.how[k] == MAX else -1.0 for k in extreme]
            highs = self.all_reduce_max([s * metrics.values[k] for s, k in zip(signs, extreme)])
            out.update({k: s * v for k, s, v in zip(extreme, signs, highs)})
        return {k: out[k] for k in names}

    def _sums_and_means(self, metrics: ShareMetrics, names: list[str]) -> dict[str, float]:
        """Sums over ranks of (value x weight, weight) pairs (weight 1 for a sum); a replica that is not its
        share's leader contributes zeros, except to a rank's ``own`` metrics."""
        parts: list[float] = []
        for k in names:
            weight = metrics.weights[k] if metrics.how[k] == MEAN else 1.0
            counted = self.leader or k in metrics.own
            parts += [metrics.values[k] * weight, weight] if counted else [0.0, 0.0]
        sums = self.all_reduce_sum(parts)
        out = {}
        for i, k in enumerate(names):
            value, weight = sums[2 * i], sums[2 * i + 1]
            out[k] = value / weight if metrics.how[k] == MEAN and weight > 0 else value
        return out


SINGLE_SHARE = DataShare()


def data_share(ctx: DistContext, replicas: int = 1) -> DataShare:
    """This rank's share when ``replicas`` consecutive ranks hold each share (a collective when ``replicas`` > 1:
    every rank creates every share's process group)."""
    if not ctx.distributed:
        return SINGLE_SHARE
    gather = _gather_one
    if replicas > 1:
        group = new_sequence_parallel_group(replicas)
        gather = lambda obj: ctx.all_gather_object(obj, group=group)  # noqa: E731
    return DataShare(
        index=ctx.rank // replicas,
        count=ctx.world_size // replicas,
        replicas=replicas,
        leader=ctx.rank % replicas == 0,
        all_reduce_sum=ctx.all_reduce_sum,
        all_reduce_max=ctx.all_reduce_max,
        gather_replicas=gather,
    )


def select_share(
    batch: RolloutBatch, share: DataShare, step_groups: torch.Tensor | None = None
) -> RolloutBatch:
    """This rank's share of a whole step's batch: the rows of groups ``step_groups[lo:hi]`` (``step_groups``: the
    step's group ids, sorted; default the batch's own). For a rollout that gathers (e.g. to filter groups on
    global statistics) and then keeps its share. The share carries ``step_groups``; one share is the batch."""
    if not share.distributed:
        return batch
    groups = torch.unique(batch.group_ids, sorted=True) if step_groups is None else step_groups
    lo, hi = share.bounds(len(groups))
    local = batch.select(torch.isin(batch.group_ids, groups[lo:hi]).nonzero().flatten())
    local.step_groups = groups
    return local
