"""The reward-model demonstration, end to end: pairs -> SFT start -> `posttrain rm` -> GRPO on the reward model alone.

Run: ``OMP_NUM_THREADS=1 python benchmarks/rm_demo.py`` (docs/reward-models.md has the measured figures). Each
stage runs the documented `posttrain` command (through ``posttrain.cli.main``, printed as it is run):

1. Preference pairs from the built-in arithmetic task (``python -m posttrain.rm.demo``): for each problem,
   the right answer (chosen) and ``--per-problem`` near misses (rejected: right +- 1..5). Train and held-out
   pairs come from the task's own disjoint splits, the ones `posttrain train` trains and validates on.
2. The reward model's start (``--model sft``, the default): `posttrain sft` of the untrained builtin:base on
   the task's correct answers (the built-in warm start's recipe, without its off-by-one demonstrations), a
   policy that computes the sums. ``--model builtin:tiny`` (or a directory) starts from that instead.
3. `posttrain rm` from it with a new scalar head; prints the held-out pair accuracy at each validation.
4. With ``--grpo-steps`` > 0: `posttrain train` (GRPO on builtin:tiny) with the exported reward model as the
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

from posttrain.cli import main as posttrain  # noqa: E402
from posttrain.rm.demo import REJECTED_KINDS  # noqa: E402
from posttrain.rm.demo import main as write_pairs  # noqa: E402
from posttrain.utils.metrics import read_metrics  # noqa: E402

# The built-in warm start's recipe (posttrain.sft.builtin.WARM_START) on the task's correct answers.
SFT = [
    "model.path=builtin:base",
    "sft.max_steps=800",
    "sft.epochs=1000",
    "sft.batch_size=64",
    "sft.micro_batch_size_per_gpu=64",
    "sft.optim.lr=1e-3",
    "sft.optim.warmup_steps=20",
    "sft.optim.lr_schedule=constant",
    "sft.optim.weight_decay=0",
    "sft.optim.grad_clip=1.0",
    "trainer.test_freq=400",
]
RM = [
    "rm.batch_size=32",
    "rm.micro_batch_size_per_gpu=32",
    "rm.epochs=1000",  # rm.max_steps decides
    "rm.optim.lr_schedule=constant",
    "rm.optim.warmup_steps=10",
    "rm.optim.weight_decay=0",
]


def run(argv: list[str]) -> float:
    """One `posttrain` command; returns its wall time in seconds."""
    print("$ posttrain " + " ".join(argv), flush=True)
    began = time.monotonic()
    code = posttrain(argv)
    if code:
        raise SystemExit(f"posttrain {argv[0]} exited with code {code}")
    return time.monotonic() - began


def reward_model_start(args, run_dir: Path) -> str:
    if args.model != "sft":
        return args.model
    seconds = run(["sft", *SFT, f"trainer.run_dir={run_dir / 'sft'}", "trainer.loggers=[jsonl]"])
    val = [r for r in read_metrics(run_dir / "sft" / "metrics.jsonl") if "val/accuracy" in r]
    print(
        f"SFT start: {seconds:.0f} s, held-out greedy accuracy "
        + " / ".join(f"{r['val/accuracy']:.3f} (step {r['step']})" for r in val)
    )
    return str(run_dir / "sft" / "sft_model")


def train_reward_model(args, run_dir: Path) -> Path:
    pairs = run_dir / "pairs"
    write_pairs([str(pairs), "--kind", args.kind, "--per-problem", str(args.per_problem)])
    start = reward_model_start(args, run_dir)
    argv = [
        "rm",
        f"model.path={start}",
        f"trainer.run_dir={run_dir / 'rm'}",
        f"data.train_files=[{pairs / 'train.jsonl'}]",
        f"data.val_files=[{pairs / 'val.jsonl'}]",
        *RM,
        f"rm.max_steps={args.steps}",
        f"rm.optim.lr={args.lr}",
        f"trainer.test_freq={args.rm_test_freq}",
        "trainer.loggers=[jsonl]",
    ]
    seconds = run(argv)
    print(f"{'step':>5} {'val acc':>8} {'margin':>8} {'mean':>8} {'std':>8}")
    for row in read_metrics(run_dir / "rm" / "metrics.jsonl"):
        if "val/accuracy" in row:
            print(
                f"{row['step']:>5} {row['val/accuracy']:>8.3f} {row['val/margin']:>8.3f} "
                f"{row['val/reward_mean']:>8.3f} {row['val/reward_std']:>8.3f}"
            )
    print(f"{args.steps} steps in {seconds:.0f} s (model load, validation and export included)")
    return run_dir / "rm" / "reward_model"


def grpo(args, run_dir: Path, reward_model: Path | None) -> list[dict]:
    """GRPO on builtin:tiny, on the reward model alone (or on the rule when ``reward_model`` is None)."""
    argv = [
        "train",
        f"trainer.run_dir={run_dir}",
        f"trainer.total_steps={args.grpo_steps}",
        f"trainer.test_freq={args.test_freq}",
        "trainer.loggers=[jsonl]",
    ]
    if reward_model is not None:
        argv += ["reward.model.enable=true", f"reward.model.path={reward_model}", "reward.rule_weight=0"]
    print(f"{args.grpo_steps} GRPO steps in {run(argv):.0f} s")
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
    ap.add_argument(
        "--model",
        default="sft",
        help="the reward model's start: sft (a clean SFT of builtin:base) or a model.path",
    )
    ap.add_argument("--kind", default="offset", choices=REJECTED_KINDS, help="what the rejected answer is")
    ap.add_argument("--per-problem", type=int, default=10, help="pairs per problem")
    ap.add_argument("--steps", type=int, default=800, help="reward-model optimizer steps")
    ap.add_argument("--rm-test-freq", type=int, default=50, help="reward-model validation every N steps")
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
