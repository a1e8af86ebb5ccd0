"""The process group a run lives in: who am I, how many are we, and the few collectives the trainer uses.

A run launched by ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) joins the default process group: NCCL
on CUDA, gloo on CPU. A plain ``posttrain train`` is a world of one and never touches torch.distributed.
Every collective here is a no-op for a world of one, so the trainer is written once. Ranks that all run on
this machine (a loopback ``MASTER_ADDR``) listen on loopback only (posttrain.parallel.rendezvous).

Data parallel (DP) and sequence parallel (SP) ranks: ranks ``[d * sp, (d + 1) * sp)`` form DP rank ``d``'s
SP group; they see the same samples and each holds a slice of every sequence (posttrain.parallel.ulysses).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.parallel.rendezvous import local_rendezvous
from posttrain.utils.run_lock import lock_run_dir

log = logging.getLogger("posttrain")

EXIT_COLLECTIVE_FAILURE = 1


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job.

    Attributes:
        rank, world_size: global rank and number of processes (1 when not launched by torchrun).
        local_rank: rank on this node (selects the CUDA device).
        device: where this rank computes.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs, metrics, checkpoints' small files and exports."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def dp_rank(self, sp_size: int) -> int:
        """Data-parallel rank of this process when SP groups have ``sp_size`` ranks."""
        return self.rank // sp_size

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_gather_object(self, obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
        """Every rank's ``obj`` (of ``group``, default all ranks), in rank order (pickled; for small things:
        results, metrics, lists)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any rank."""
        return self.all_reduce_sum([float(flag)])[0] > 0

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks of a list of floats (float64 on this rank's device)."""
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def all_reduce_max(self, values: list[float]) -> list[float]:
        """Element-wise maximum over ranks of a list of floats (float64 on this rank's device)."""
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def _all_reduce(self, values: list[float], op: dist.ReduceOp) -> list[float]:
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()


def select_device(cfg: PostTrainConfig) -> torch.device:
    """trainer.device: 'auto' picks CUDA when present; asking for CUDA without one is an error."""
    want = cfg.trainer.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.device='cuda' but no CUDA device is visible; use trainer.device=cpu or auto"
        )
    if want == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(want)


def launched_world_size() -> int:
    """WORLD_SIZE from the environment (set by torchrun), 1 otherwise."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """RANK from the environment (set by torchrun), 0 otherwise: usable before the process group exists."""
    return int(os.environ.get("RANK", "0"))


def init_distributed(device: torch.device, timeout_s: float) -> DistContext:
    """Join the job's process group when launched by torchrun; otherwise a world of one.

    ``timeout_s`` bounds every collective: a dead or hung rank makes the others fail with an error after
    that long instead of waiting forever (torchrun then stops the whole job). With NCCL the watchdog needs
    async error handling, which torch enables by default.
    """
    world = launched_world_size()
    if world == 1:
        return DistContext(device=device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            dist.init_process_group(
                backend=backend,
                timeout=timeout,
                device_id=device if device.type == "cuda" else None,
                **local_rendezvous(rank, world, timeout),
            )
        except dist.DistError as exc:  # the store's timeouts: DistStoreError, DistNetworkError
            raise rendezvous_failure(exc, rank, world, timeout_s) from None
    if dist.get_world_size() != world:
        raise RuntimeError(f"WORLD_SIZE={world} but the process group has {dist.get_world_size()} ranks")
    if rank != 0:
        # One voice per job: other ranks only report warnings and errors.
        logging.getLogger("posttrain").setLevel(logging.WARNING)
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=device)


def rendezvous_failure(exc: BaseException, rank: int, world: int, timeout_s: float) -> ConfigError:
    """The error for ranks that did not all meet: rank 0's store saw too few ranks, or a rank could not reach
    rank 0's store, within the timeout. What the ranks were told is the usual cause (a node not started, another
    MASTER_ADDR/MASTER_PORT/WORLD_SIZE on one node, an address the other nodes cannot reach), so it is named."""
    where = (
        f"MASTER_ADDR={os.environ.get('MASTER_ADDR', '?')} MASTER_PORT={os.environ.get('MASTER_PORT', '?')}"
    )
    # DistNetworkError: no connection to rank 0's store at all; otherwise the store answered but not every rank came.
    side = (
        "could not reach rank 0" if isinstance(exc, dist.DistNetworkError) else "waited for the other ranks"
    )
    return ConfigError(
        f"rank {rank} of {world} (WORLD_SIZE={world}) {side} at {where} for trainer.dist_timeout_s={timeout_s:g} s "
        f"and gave up ({str(exc).splitlines()[0]}): start every node's ranks with the same MASTER_ADDR, "
        "MASTER_PORT and WORLD_SIZE, and make MASTER_ADDR an address of rank 0's node that every node reaches "
        "(docs/distributed.md, Failures)"
    )


# What gloo raises (torch 2.13) when a peer is gone or silent: a plain RuntimeError, not a DistError, whose
# text comes from gloo's transport ("[.../gloo/transport/tcp/pair.cc:537] Read error ...: Connection reset by
# peer", "[.../unbound_buffer.cc:78] Timed out waiting 5000ms for recv", "Application timeout caused pair
# closure"). Matched narrowly, on plain RuntimeErrors only.
_GLOO_FAILURE_TEXT = ("gloo/transport", "application timeout caused pair closure")


def is_collective_failure(exc: BaseException) -> bool:
    """Errors torch.distributed raises when a peer is gone (connection closed) or silent (timeout)."""
    if isinstance(exc, dist.DistError):  # NCCL's watchdog, the store, the network layer
        return True
    text = str(exc).lower()
    return type(exc) is RuntimeError and any(marker in text for marker in _GLOO_FAILURE_TEXT)


def abort_on_collective_failure(exc: BaseException, ctx: DistContext, timeout_s: float) -> None:
    """End this rank now when a collective failed: say why, then exit without the orderly teardown.

    The teardown (destroy_process_group, atexit handlers) talks to the peers and can block on the very rank
    that hung; exiting at once makes torchrun stop the rest of the job promptly. Output is flushed first;
    the run directory lock is released by the kernel with the process.
    """
    if not (ctx.distributed and is_collective_failure(exc)):
        return
    log.error(
        "rank %d of %d: a collective failed or waited longer than trainer.dist_timeout_s=%g s; another rank has "
        "probably died or hung (see its own error above). Stopping this rank.",
        ctx.rank,
        ctx.world_size,
        timeout_s,
        exc_info=exc,
    )
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(EXIT_COLLECTIVE_FAILURE)


def shutdown_distributed(ctx: DistContext | None = None) -> None:
    """Tear down the process group this run joined. A world of one never created one: a group that exists
    then belongs to someone else (an in-process vLLM engine makes its own) and is left alone."""
    if (ctx is None or ctx.distributed) and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def ranked_run(device: torch.device, run_dir: str | Path, timeout_s: float) -> Iterator[DistContext]:
    """The life of a training command on each of its ranks (`posttrain train`, `posttrain rm`).

    Rank 0 takes the run directory's lock before anything is written there; every rank joins the process group
    (none for a world of one); a failed collective ends the job instead of hanging it; the group and the lock are
    released on the way out, however the body ends. Where ranks must leave together, the body ends with
    ``ctx.barrier()``: gloo aborts a process whose peer tears the group down while it still talks to it.
    """
    lock = lock_run_dir(run_dir, take=launched_rank() == 0)
    try:
        ctx = init_distributed(device, timeout_s)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    try:
        yield ctx
    except Exception as exc:
        abort_on_collective_failure(exc, ctx, timeout_s)  # exits when a peer is gone
        raise
    finally:
        shutdown_distributed(ctx)
        if lock is not None:
            lock.release()


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[lo, hi) of the contiguous slice of ``n`` items rank ``rank`` handles (sizes differ by at most one)."""
    return rank * n // world_size, (rank + 1) * n // world_size
