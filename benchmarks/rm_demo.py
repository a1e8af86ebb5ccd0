"""The reward-model demonstration: `posttrain rm` on preference pairs from the built-in arithmetic task.

Run: ``OMP_NUM_THREADS=1 python benchmarks/rm_demo.py`` (see docs/reward-models.md for the measured figures).

Each arithmetic problem gives one pair: the correct answer (chosen) and a wrong one (rejected; ``--kind``:
``offset``, the right answer plus a nonzero offset of at most 5; ``other``, another problem's answer;
``refusal``, "I do not know."). Training and validation problems are disjoint (the task's own splits), so
the held-out accuracy is on problems the reward model never saw. The model starts from ``--model``
(default the built-in tiny Qwen2, ``builtin:base``, untrained) with a new scalar head. Prints the held-out pair accuracy, mean margin
and reward mean/std at each validation, the wall time, and where the exported model is.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.config.load import build_config  # noqa: E402
from posttrain.rm.command import run_rm_command  # noqa: E402
from posttrain.rm.demo import REJECTED_KINDS, write_arithmetic_pairs  # noqa: E402
from posttrain.utils.metrics import read_metrics  # noqa: E402

DEMO = {
    "rm.batch_size": 32,
    "rm.micro_batch_size_per_gpu": 32,
    "rm.optim.weight_decay": 0.0,
    "rm.optim.warmup_steps": 10,
    "rm.optim.lr_schedule": "constant",
    "trainer.test_freq": 20,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=2000, help="training problems (one pair each)")
    ap.add_argument("--val", type=int, default=200, help="held-out problems")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps")
    ap.add_argument("--kind", default="offset", choices=REJECTED_KINDS, help="what the rejected answer is")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--model", default="builtin:base", help="model.path (a causal LM or a classifier)")
    ap.add_argument("--run-dir", default="", help="default: a temporary directory")
    args = ap.parse_args()
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="rm_demo_"))
    train, val = write_arithmetic_pairs(run_dir / "pairs", args.train, args.val, seed=1, kind=args.kind)
    overrides = {
        **DEMO,
        "model.path": args.model,
        "rm.optim.lr": args.lr,
        "data.train_files": f"[{train}]",
        "data.val_files": f"[{val}]",
        "trainer.run_dir": str(run_dir / "run"),
        "rm.max_steps": args.steps,
        "rm.epochs": max(1, -(-args.steps * DEMO["rm.batch_size"] // args.train)),
    }
    cfg = build_config(overrides=[f"{k}={v}" for k, v in overrides.items()])
    began = time.monotonic()
    out = run_rm_command(cfg, quiet=True)
    seconds = time.monotonic() - began
    print("posttrain rm " + " ".join(f"{k}={v}" for k, v in overrides.items()))
    print(f"{'step':>5} {'val acc':>8} {'margin':>8} {'mean':>8} {'std':>8}")
    for row in read_metrics(run_dir / "run" / "metrics.jsonl"):
        if "val/accuracy" in row:
            print(
                f"{row['step']:>5} {row['val/accuracy']:>8.3f} {row['val/margin']:>8.3f} "
                f"{row['val/reward_mean']:>8.3f} {row['val/reward_std']:>8.3f}"
            )
    print(
        f"{args.steps} steps in {seconds:.0f} s (model load, validation and export included); exported {out}"
    )


if __name__ == "__main__":
    main()
