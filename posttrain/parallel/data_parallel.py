"""The data-parallel view of a pass: its rank layout plus the collectives the update loop uses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from posttrain.batching.micro import RankLayout
from posttrain.parallel.runtime import DistContext


def _no_reduce(values: list[float]) -> list[float]:
    return list(values)


def _gather_one(obj: object) -> list[object]:
    return [obj]


@dataclass(frozen=True)
class DataParallel(RankLayout):
    """How a role's work is spread over ranks (the default: one rank does everything).

    Attributes (besides :class:`RankLayout`'s dp_rank, dp_size, keep_groups):
        grad_ranks: ranks the sharded model averages gradients over (all ranks: DP x SP); each rank's loss
            is scaled by it so the average becomes the sum it should be.
        replicas: ranks that process the same data (the SP group size): their metrics count once.
        all_reduce_sum: element-wise sum of a list of floats over all ranks.
        all_gather: every rank's (picklable) object, in rank order.
    """

    grad_ranks: int = 1
    replicas: int = 1
    all_reduce_sum: Callable[[list[float]], list[float]] = field(default=_no_reduce, compare=False)
    all_gather: Callable[[object], list[object]] = field(default=_gather_one, compare=False)


SINGLE_RANK = DataParallel()


def data_parallel(ctx: DistContext, sp_size: int = 1, keep_groups: bool = False) -> DataParallel:
    """The DataParallel view of a role whose SP groups have ``sp_size`` ranks (gradients averaged over all);
    ``keep_groups``: spread whole prompt groups over the ranks where possible (the prefix grouper)."""
    if not ctx.distributed:
        return DataParallel(keep_groups=keep_groups)
    return DataParallel(
        dp_rank=ctx.rank // sp_size,
        dp_size=ctx.world_size // sp_size,
        keep_groups=keep_groups,
        grad_ranks=ctx.world_size,
        replicas=sp_size,
        all_reduce_sum=ctx.all_reduce_sum,
        all_gather=ctx.all_gather_object,
    )
