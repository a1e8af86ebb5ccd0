"""The reward-model demonstration, end to end: pairs -> `posttrain rm` -> GRPO on the reward model alone.

Run: ``OMP_NUM_THREADS=1 python benchmarks/rm_demo.py`` (docs/reward-models.md has the measured figures).

1. Preference pairs from the built-in arithmetic task (``python -m posttrain.rm.demo``): for each problem,
   the right answer (chosen) and ``--per-problem`` near misses (rejected: right +- 1..5). Train and held-out
   pairs come from the task's own disjoint splits, the ones `posttrain train` trains and validates on.
2. `posttrain rm` from ``--model`` (default ``builtin:tiny``, the demo's warm-started policy) with a new
   scalar head; prints the held-out pair accuracy at each validation.
3. With ``--grpo-steps`` > 0: `posttrain train` (GRPO on builtin:tiny) with the exported reward model as the
   only reward (``reward.rule_weight=0``): the rule still runs, for the log and for validation, so the table
   shows side by side what the policy is trained on (the reward model's score) and what is true (the rule's
   accuracy on the training samples and on the held-out problems). A policy that fooled the reward model
   would raise the first and not the others. ``--rule-baseline`` also runs the same GRPO on the rule reward.
   The two curves are drawn in ``<run-dir>/rm_vs_rule.png``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.config.load import build_config  # noqa: E402
from posttrain.rl.train_command import run_training  # noqa: E402
from posttrain.rm.command import run_rm_command  # noqa: E402
from posttrain.rm.demo import REJECTED_KINDS, write_task_pairs  # noqa: E402
from posttrain.utils.metrics import read_metrics  # noqa: E402

RM = {
    "rm.batch_size": 32,
    "rm.micro_batch_size_per_gpu": 32,
    "rm.optim.weight_decay": 0.0,
    "rm.optim.warmup_steps": 10,
    "rm.optim.lr_schedule": "constant",
    "trainer.test_freq": 20,
}


def train_reward_model(args, run_dir: Path) -> Path:
    train, val = write_task_pairs(run_dir / "pairs", kind=args.kind, per_problem=args.per_problem)
    overrides = {
        **RM,
        "model.path": args.model,
        "rm.optim.lr": args.lr,
        "data.train_files": f"[{train}]",
        "data.val_files": f"[{val}]",
        "trainer.run_dir": str(run_dir / "rm"),
        "rm.max_steps": args.steps,
        "rm.epochs": 1000,  # rm.max_steps decides
    }
    began = time.monotonic()
    out = run_rm_command(build_config(overrides=[f"{k}={v}" for k, v in overrides.items()]), quiet=True)
    seconds = time.monotonic() - began
    print("posttrain rm " + " ".join(f"{k}={v}" for k, v in overrides.items()))
    print(f"{'step':>5} {'val acc':>8} {'margin':>8} {'mean':>8} {'std':>8}")
    for row in read_metrics(run_dir / "rm" / "metrics.jsonl"):
        if "val/accuracy" in row:
            print(
                f"{row['step']:>5} {row['val/accuracy']:>8.3f} {row['val/margin']:>8.3f} "
                f"{row['val/reward_mean']:>8.3f} {row['val/reward_std']:>8.3f}"
            )
    print(
        f"{args.steps} steps in {seconds:.0f} s (model load, validation and export included); exported {out}"
    )
    return out


def grpo(args, run_dir: Path, reward_model: Path | None) -> list[dict]:
    """GRPO on builtin:tiny, on the reward model alone (or on the rule when ``reward_model`` is None)."""
    overrides = {
        "trainer.run_dir": str(run_dir),
        "trainer.total_steps": args.grpo_steps,
        "trainer.test_freq": args.test_freq,
        "trainer.loggers": "[jsonl]",
    }
    if reward_model is not None:
        overrides.update(
            {"reward.model.enable": "true", "reward.model.path": str(reward_model), "reward.rule_weight": 0}
        )
    began = time.monotonic()
    run_training(build_config(overrides=[f"{k}={v}" for k, v in overrides.items()]), quiet=True)
    print("posttrain train " + " ".join(f"{k}={v}" for k, v in overrides.items()))
    print(f"{args.grpo_steps} GRPO steps in {time.monotonic() - began:.0f} s")
    return read_metrics(run_dir / "metrics.jsonl")


def print_curves(rows: list[dict]) -> None:
    print(f"{'step':>5} {'rm score':>9} {'rule acc (train)':>17} {'val acc (rule)':>15}")
    for row in rows:  # step 0: the validation before training only
        score = row.get("reward/model_score_mean", float("nan"))
        rule = row.get("reward/rule_accuracy", float("nan"))
        val = f"{row['val/accuracy']:.3f}" if "val/accuracy" in row else ""
        print(f"{row['step']:>5} {score:>9.3f} {rule:>17.3f} {val:>15}")


def plot(rows: list[dict], baseline: list[dict] | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    trained = [r for r in rows if "reward/rule_accuracy" in r]
    steps = [r["step"] for r in trained]
    left.plot(steps, [r["reward/model_score_mean"] for r in trained])
    left.set(title="trained on: reward-model score", xlabel="GRPO step")
    right.plot(steps, [r["reward/rule_accuracy"] for r in trained], label="rule accuracy, training samples")
    val = [r for r in rows if "val/accuracy" in r]
    right.plot([r["step"] for r in val], [r["val/accuracy"] for r in val], "o-", label="held-out accuracy")
    if baseline:
        bval = [r for r in baseline if "val/accuracy" in r]
        right.plot(
            [r["step"] for r in bval],
            [r["val/accuracy"] for r in bval],
            "s--",
            label="held-out, GRPO on rule",
        )
    right.set(title="true: the rule reward", xlabel="GRPO step", ylim=(0, 1))
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"curves: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:tiny", help="model.path of the reward model's start")
    ap.add_argument("--kind", default="offset", choices=REJECTED_KINDS, help="what the rejected answer is")
    ap.add_argument("--per-problem", type=int, default=4, help="pairs per problem")
    ap.add_argument("--steps", type=int, default=150, help="reward-model optimizer steps")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--grpo-steps", type=int, default=30, help="0: the reward model only")
    ap.add_argument("--test-freq", type=int, default=10, help="GRPO validation every N steps")
    ap.add_argument("--rule-baseline", action="store_true", help="also run GRPO on the rule reward")
    ap.add_argument("--run-dir", default="", help="default: a temporary directory")
    args = ap.parse_args()
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="rm_demo_"))
    reward_model = train_reward_model(args, run_dir)
    if not args.grpo_steps:
        return
    rows = grpo(args, run_dir / "grpo_rm", reward_model)
    print_curves(rows)
    baseline = grpo(args, run_dir / "grpo_rule", None) if args.rule_baseline else None
    if baseline:
        print_curves(baseline)
    plot(rows, baseline, run_dir / "rm_vs_rule.png")


if __name__ == "__main__":
    main()
