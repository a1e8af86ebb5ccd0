"""The process-reward-model demonstration: step-labelled arithmetic chains -> an SFT start that adds ->
`posttrain rm rm.kind=prm` -> held-out step accuracy.

Run: ``OMP_NUM_THREADS=1 python benchmarks/prm_demo.py`` (docs/reward-models.md has the measured figures). Each
stage runs the documented `posttrain` command (through ``posttrain.cli.main``, printed as it is run):

1. Chains (``python -m posttrain.rm.prm_demo``): "Add 4, 5, 4." then "4+5=9", "9+4=13"; half the chains have one
   step off by 1-3, labelled false (``--after-error``: the chain stops there, or goes on from the wrong sum with
   later steps false too). Held-out chains have prompts no training or SFT chain has; ``--sft-rows`` more
   correct chains are written as SFT rows (prompt, the steps one per line).
2. The PRM's start: `posttrain sft` of the untrained builtin:base on the correct chains, so that the model can
   add. A PRM trained from builtin:base itself stays at the majority label (``--from-scratch`` runs it too):
   the tiny model does not learn the sums from a two-label head's signal in a few hundred steps.
3. `posttrain rm rm.kind=prm` from that start; the held-out step and chain accuracy at each validation.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rm_demo import run  # noqa: E402  (this folder: each posttrain command printed, run, timed)

from posttrain.rm.prm_demo import AFTER_ERROR  # noqa: E402
from posttrain.rm.prm_demo import main as write_chains  # noqa: E402
from posttrain.utils.metrics import read_metrics  # noqa: E402

SFT = [
    "model.path=builtin:base",
    "sft.batch_size=32",
    "sft.micro_batch_size_per_gpu=32",
    "sft.epochs=10",  # sft.max_steps decides
    "sft.optim.lr=1e-3",
    "sft.optim.warmup_steps=10",
    "trainer.test_freq=0",
]
PRM = [
    "rm.kind=prm",
    "rm.micro_batch_size_per_gpu=32",
    "rm.optim.warmup_steps=10",
    "rm.optim.lr_schedule=cosine",
    "rm.optim.min_lr_ratio=0.1",
]


def sft_argv(rows: Path, steps: int, response_length: int, run_dir: Path) -> list[str]:
    """`posttrain sft` of the untrained builtin:base on correct chains: a model that writes chains and adds."""
    return [
        "sft",
        *SFT,
        "data.max_prompt_length=48",
        f"data.max_response_length={response_length}",
        f"sft.train_files=[{rows}]",
        f"sft.max_steps={steps}",
        f"trainer.run_dir={run_dir}",
        "trainer.loggers=[jsonl]",
    ]


def train_prm(args, start: str, data: Path, run_dir: Path) -> list[dict]:
    argv = [
        "rm",
        *PRM,
        f"model.path={start}",
        f"data.train_files=[{data / 'train.jsonl'}]",
        f"data.val_files=[{data / 'val.jsonl'}]",
        f"rm.epochs={args.epochs}",
        f"rm.optim.lr={args.lr}",
        f"trainer.test_freq={args.test_freq}",
        f"trainer.run_dir={run_dir}",
        "trainer.loggers=[jsonl]",
    ]
    seconds = run(argv)
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "val/step_accuracy" in r]
    print(f"{'step':>5} {'val step acc':>13} {'val chain acc':>14} {'val loss':>9}")
    for r in rows:
        print(
            f"{r['step']:>5} {r['val/step_accuracy']:>13.3f} {r['val/chain_accuracy']:>14.3f} {r['val/loss']:>9.3f}"
        )
    print(f"PRM from {start}: {seconds:.0f} s")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--run-dir", type=Path, default=None, help="where the runs go (default: a temporary folder)"
    )
    ap.add_argument("--terms", type=int, default=3, help="numbers per chain (steps: terms - 1)")
    ap.add_argument("--max-operand", type=int, default=9)
    ap.add_argument(
        "--after-error",
        choices=AFTER_ERROR,
        default="stop",
        help="what follows a wrong step (posttrain.rm.prm_demo)",
    )
    ap.add_argument(
        "--response-length", type=int, default=16, help="SFT response tokens (32 for 4 terms of 1-9)"
    )
    ap.add_argument("--train", type=int, default=6000, help="training chains")
    ap.add_argument("--val", type=int, default=400, help="held-out chains")
    ap.add_argument("--sft-rows", type=int, default=8000, help="correct chains for the SFT start")
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--epochs", type=int, default=3, help="PRM epochs over the training chains")
    ap.add_argument("--lr", type=float, default=2e-4, help="the PRM's peak learning rate")
    ap.add_argument("--test-freq", type=int, default=50)
    ap.add_argument("--from-scratch", action="store_true", help="also train the PRM from builtin:base")
    args = ap.parse_args()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="prm-demo-"))
    data = run_dir / "chains"
    chains = [
        "--terms",
        str(args.terms),
        "--max-operand",
        str(args.max_operand),
        "--after-error",
        args.after_error,
    ]
    write_chains(
        [str(data), "--train", str(args.train), "--val", str(args.val), "--sft", str(args.sft_rows), *chains]
    )
    sft_dir = run_dir / "sft"
    print(
        f"SFT start: {run(sft_argv(data / 'sft.jsonl', args.sft_steps, args.response_length, sft_dir)):.0f} s"
    )
    train_prm(args, str(sft_dir / "sft_model"), data, run_dir / "prm")
    if args.from_scratch:
        train_prm(args, "builtin:base", data, run_dir / "prm-scratch")
    print(f"runs in {run_dir}")


if __name__ == "__main__":
    main()
