"""Programs the distributed tests launch with torchrun (one process per rank, gloo on loopback).

    python -m torch.distributed.run --nproc_per_node 2 tests/parallel/workers.py <scenario> <out_dir> [k=v ...]

Each scenario writes what the test compares into ``out_dir`` (rank 0 only unless noted).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch


def _setup_threads() -> None:
    torch.set_num_threads(1)


def update(out: Path, options: dict[str, str]) -> None:
    """One actor (or critic) update on a fixed batch; saves the updated full weights and the metrics."""
    from tests.parallel.update_case import run_update_case

    run_update_case(out, options)


def train(out: Path, options: dict[str, str]) -> None:
    """`posttrain train` with the given overrides (the run dir is in them)."""
    from posttrain.config.load import build_config
    from posttrain.rl.train_command import run_training

    cfg = build_config([], [f"{k}={v}" for k, v in options.items()])
    metrics = run_training(cfg, quiet=True)
    if int(__import__("os").environ.get("RANK", "0")) == 0:
        torch.save(metrics, out / "metrics.pt")


def collective_bytes(out: Path, options: dict[str, str]) -> None:
    """`train` with every torch.distributed call the trainer makes from Python counted (bytes this rank sends:
    pickled objects, tensors); FSDP2's own parameter and gradient collectives are not these calls. Each rank
    writes ``bytes_<rank>.json``: {caller: bytes}."""
    import json
    import os

    from tests.parallel.collective_bytes import count_collective_bytes

    with count_collective_bytes() as counts:
        train(out, options)
    (out / f"bytes_{os.environ['RANK']}.json").write_text(json.dumps(counts))


class _StandIn:
    """A rollout host whose every call answers ``answer(method, *args)`` (a value, or an exception to raise)."""

    def __init__(self, answer):
        self.answer = answer

    def call(self, method, *args):
        from concurrent.futures import Future

        fut, result = Future(), self.answer(method, *args)
        if isinstance(result, Exception):
            fut.set_exception(result)
        else:
            fut.set_result(result)
        return fut

    def close(self) -> None:
        """Nothing to stop."""


def _queue_on_ranks(answer, max_staleness: int, shares: bool):
    """(rank, a RolloutQueue over a gloo group of the launched ranks: rank 0 holds a stand-in host)."""
    import datetime

    import torch.distributed as dist

    from posttrain.parallel.rendezvous import local_rendezvous
    from posttrain.parallel.runtime import DistContext
    from posttrain.parallel.shares import SINGLE_SHARE, data_share
    from posttrain.rl.overlap.queue import RolloutQueue

    timeout = datetime.timedelta(seconds=60)
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", timeout=timeout, **local_rendezvous(int(os.environ["RANK"]), world, timeout)
    )
    rank = dist.get_rank()
    ctx = DistContext(rank=rank, world_size=dist.get_world_size())
    host = _StandIn(answer) if rank == 0 else None
    share = data_share(ctx) if shares else SINGLE_SHARE
    return rank, RolloutQueue(host, max_staleness, 0, 4, dist=ctx, share=share)


def ahead_failure(out: Path, options: dict[str, str]) -> None:
    """Rank 0's rollout worker fails while taking a step: rank 0 raises the cause, the others an error that
    names it (not a wait until the collective timeout). Each rank writes ``error_<rank>.txt``."""
    import torch.distributed as dist

    rank, ahead = _queue_on_ranks(lambda method, *args: ValueError(f"{method} {args} broke"), 1, False)
    try:
        ahead.take(1)
        message = "no error"
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}"
    (out / f"error_{rank}.txt").write_text(message)
    dist.destroy_process_group()


def ahead_shares(out: Path, options: dict[str, str]) -> None:
    """Rank 0's worker returns a whole step of 4 groups x 2 samples; each rank writes the group ids of the
    batch it gets (``groups_<rank>.txt``) and the step's reward metric."""
    import torch.distributed as dist

    from posttrain.data.batch import build_rollout_batch
    from posttrain.rl.collect.context import GeneratedStep

    def whole_step(method, *args):
        batch = build_rollout_batch([[5, 6]] * 8, [[7, 8, 9]] * 8, [0, 0, 1, 1, 2, 2, 3, 3], pad_token_id=0)
        batch.policy_versions = torch.zeros(8, dtype=torch.long)
        return GeneratedStep(batch, {"reward/mean": 0.5}, {})

    rank, ahead = _queue_on_ranks(whole_step, 0, True)
    batch, metrics = ahead.take(1)
    (out / f"groups_{rank}.txt").write_text(f"{batch.group_ids.tolist()} {metrics['reward/mean']}")
    dist.destroy_process_group()


def mesh(out: Path, options: dict[str, str]) -> None:
    """Each rank joins the group as the trainer does, builds the mesh a model is sharded on
    (``fsdp_size`` from the options; ``timeout_s``, default 60, bounds the rendezvous) and writes ``mesh_<rank>.json``: its pid, node (torchrun's GROUP_RANK) and the
    ranks of its shard and replicate groups, read from the mesh; it leaves once ``out/release`` exists."""
    import json
    import time

    import torch.distributed as dist

    from posttrain.parallel.fsdp import sharding_mesh
    from posttrain.parallel.runtime import init_distributed, shutdown_distributed

    ctx = init_distributed(torch.device("cpu"), float(options.get("timeout_s", 60)))
    grid = sharding_mesh(ctx, int(options["fsdp_size"]))
    groups = {name: dist.get_process_group_ranks(grid.get_group(name)) for name in grid.mesh_dim_names}
    node = int(os.environ["GROUP_RANK"])
    said = {"pid": os.getpid(), "node": node, "nodes": ctx.all_gather_object(node), "groups": groups}
    (out / f"mesh_{ctx.rank}.json").write_text(json.dumps(said))
    while not (out / "release").exists():
        time.sleep(0.1)
    ctx.barrier()
    shutdown_distributed(ctx)


SCENARIOS = {
    "mesh": mesh,
    "ahead_shares": ahead_shares,
    "update": update,
    "train": train,
    "collective_bytes": collective_bytes,
    "ahead_failure": ahead_failure,
}

if __name__ == "__main__":
    _setup_threads()
    # The repository root, so that `tests.parallel.*` helpers import the same way as under pytest.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    scenario, out_dir, *rest = sys.argv[1:]
    SCENARIOS[scenario](Path(out_dir), dict(item.split("=", 1) for item in rest))
