"""The data-parallel view of a pass: its rank layout plus the collectives the update loop uses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from posttrain.batching.micro import RankLayout
from posttrain.parallel.runtime import DistContext


def _no_reduce(values: list[float]) -> list[float]:
    return list(values)


@dataclass(frozen=True)
class DataParallel(RankLayout):
    """How a role's work is spread over ranks (the default: one rank does everything).

    Each rank holds its share of the step's samples (rank-local data, `posttrain.parallel.shares`) and
    computes on its own rows; only tensors of a few floats cross ranks.

    Attributes (besides :class:`RankLayout`'s dp_rank, dp_size, keep_groups, share_ranks):
        grad_ranks: ranks the sharded model averages gradients over (all ranks: DP x SP); each rank's loss
            is scaled by it so the average becomes the sum it should be.
        replicas: ranks that process the same rows (the SP group size): their metrics count once.
        share_leader: this rank is the first of the ranks holding its share: a per-share count is summed over
            the share leaders only (:meth:`share_sum`).
        all_reduce_sum, all_reduce_max: element-wise sum / maximum of a list of floats over all ranks.
    """

    grad_ranks: int = 1
    replicas: int = 1
    share_leader: bool = True
    all_reduce_sum: Callable[[list[float]], list[float]] = field(default=_no_reduce, compare=False)
    all_reduce_max: Callable[[list[float]], list[float]] = field(default=_no_reduce, compare=False)

    def share_sum(self, values: list[float]) -> list[float]:
        """Sums over the shares of per-share values (every rank holding a share passes the same values)."""
        return self.all_reduce_sum([v if self.share_leader else 0.0 for v in values])


SINGLE_RANK = DataParallel()


def data_parallel(
    ctx: DistContext, sp_size: int = 1, keep_groups: bool = False, share_size: int | None = None
) -> DataParallel:
    """The DataParallel view of a role whose SP groups have ``sp_size`` ranks (gradients averaged over all);
    ``keep_groups``: spread whole prompt groups over the ranks where possible (the prefix grouper);
    ``share_size``: consecutive ranks holding one share of the data (default ``sp_size``; a multiple of it)."""
    if not ctx.distributed:
        return DataParallel(keep_groups=keep_groups)
    share_size = share_size or sp_size
    return DataParallel(
        dp_rank=ctx.rank // sp_size,
        dp_size=ctx.world_size // sp_size,
        keep_groups=keep_groups,
        share_ranks=share_size // sp_size,
        grad_ranks=ctx.world_size,
        replicas=sp_size,
        share_leader=ctx.rank % share_size == 0,
        all_reduce_sum=ctx.all_reduce_sum,
        all_reduce_max=ctx.all_reduce_max,
    )
