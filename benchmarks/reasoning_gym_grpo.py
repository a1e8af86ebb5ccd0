"""A reasoning-gym task the tiny built-in model learns on CPU: SFT warm start, then GRPO; held-out accuracy
before and after each.

Run::

    python3 benchmarks/reasoning_gym_grpo.py                  # the documented run (several minutes on 2 cores)
    python3 benchmarks/reasoning_gym_grpo.py --grpo-steps 60  # a longer GRPO phase

It runs the two commands of docs/migrating-from-verl.md ("reasoning-gym tasks") as a user would
(``posttrain sft`` from the untrained ``builtin:base`` model, then ``posttrain train`` from the SFT model) in a
temporary run directory, and prints the held-out accuracy (greedy, ``data.num_val_examples`` questions never
trained on) at every validation of both runs, read from their ``metrics.jsonl``. Needs ``posttrain[reasoning-gym]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TASK = [
    "data.task=reasoning_gym:gcd",
    "data.task_options.max_value=40",
    "data.num_train_examples=640",
    "data.num_val_examples=64",
    "data.max_prompt_length=128",
    "data.max_response_length=4",
]


def sft_args(run_dir: Path, epochs: int) -> list[str]:
    return [
        "sft",
        "model.path=builtin:base",
        *TASK,
        "sft.batch_size=16",
        "sft.micro_batch_size_per_gpu=16",
        f"sft.epochs={epochs}",
        "sft.optim.lr=1e-3",
        "trainer.test_freq=20",
        f"trainer.run_dir={run_dir}",
    ]


def grpo_args(model: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        "train",
        f"model.path={model}",
        *TASK,
        "data.train_batch_size=16",
        "actor.ppo_mini_batch_size=16",
        f"trainer.total_steps={steps}",
        "trainer.test_freq=10",
        f"trainer.run_dir={run_dir}",
    ]


def run(args: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "posttrain.cli", *args], check=True, env=env)
    return time.perf_counter() - start


def accuracies(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(int(r.get("step", 0)), r["val/accuracy"]) for r in rows if "val/accuracy" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-epochs", type=int, default=3)
    parser.add_argument("--grpo-steps", type=int, default=40)
    parser.add_argument("--run-dir", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = args.run_dir or Path(tmp)
        sft_dir, grpo_dir = base / "sft", base / "grpo"
        sft_s = run(sft_args(sft_dir, args.sft_epochs))
        grpo_s = run(grpo_args(sft_dir / "sft_model", grpo_dir, args.grpo_steps))
        sft, grpo = accuracies(sft_dir), accuracies(grpo_dir)
    print(f"\nSFT ({sft_s:.0f} s): " + ", ".join(f"step {s}: {a:.1%}" for s, a in sft))
    print(f"GRPO ({grpo_s:.0f} s): " + ", ".join(f"step {s}: {a:.1%}" for s, a in grpo))
    print(
        f"held-out accuracy: untrained {sft[0][1]:.1%}, after SFT {sft[-1][1]:.1%}, after GRPO {grpo[-1][1]:.1%}"
    )


if __name__ == "__main__":
    main()
