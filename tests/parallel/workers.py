"""Programs the distributed tests launch with torchrun (one process per rank, gloo on loopback).

    python -m torch.distributed.run --nproc_per_node 2 tests/parallel/workers.py <scenario> <out_dir> [k=v ...]

Each scenario writes what the test compares into ``out_dir`` (rank 0 only unless noted).
"""

from __future__ import annotations

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
    from posttrain.rl.loop import run_training

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


SCENARIOS = {"update": update, "train": train, "collective_bytes": collective_bytes}

if __name__ == "__main__":
    _setup_threads()
    # The repository root, so that `tests.parallel.*` helpers import the same way as under pytest.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    scenario, out_dir, *rest = sys.argv[1:]
    SCENARIOS[scenario](Path(out_dir), dict(item.split("=", 1) for item in rest))
