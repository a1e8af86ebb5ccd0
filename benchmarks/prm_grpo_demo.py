"""GRPO on multi-step addition with a process reward model's score beside the outcome reward, against the
outcome reward alone: which reaches a held-out accuracy in fewer steps.

Run after ``benchmarks/prm_demo.py`` (whose trained PRM this takes)::

    OMP_NUM_THREADS=1 python benchmarks/prm_grpo_demo.py --prm RUNS/prm/reward_model --terms 4 --max-operand 9

1. Problems of the chains' kind ("Add 3, 4, 5, 6.\\n", answer 18), training prompts and held-out prompts from
   the same split as the PRM's chains (``posttrain.rm.prm_demo``): the held-out prompts were seen by neither the
   PRM nor any start.
2. The policy's start: a short `posttrain sft` of the untrained builtin:base on correct chains
   (``--policy-sft-steps``), so that it writes chains but often adds wrong.
3. The same `posttrain train` (GRPO, same seed) twice: on the outcome reward alone (the last step's sum,
   ``final_sum_reward``), and on that reward plus ``--prm-weight`` times the PRM's score reduced per response
   (``--reduction``: GRPO takes one score per response). Held-out accuracy is the outcome reward's in both.

Overrides after the flags go to both runs: ``algorithm.adv_estimator=reinforce_plus_plus`` with
``--reduction dense`` puts each step's score on its last token instead (docs/judges.md, "Process rewards").
``--arm`` runs one of the two, so that two shells can run them side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prm_demo import sft_argv  # noqa: E402  (this folder: the PRM demonstration's SFT start)
from rm_demo import run  # noqa: E402  (this folder: each posttrain command printed, run, timed)

import posttrain.rm.prm_demo as chains  # noqa: E402
from posttrain.utils.metrics import read_metrics  # noqa: E402


def write_problems(args, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    prompts = {"terms": args.terms, "max_operand": args.max_operand}
    for name, n, seed, held_out in (("train", 4000, 11, False), ("val", args.val, 12, True)):
        rows = chains.sum_problems(n, seed, held_out, **prompts)
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft = chains.sft_rows(4000, 13, **prompts)
    (out / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))


def policy_start(args, data: Path, run_dir: Path) -> str:
    argv = sft_argv(data / "sft.jsonl", args.policy_sft_steps, args.response_length, run_dir)
    print(f"policy start: {run(argv):.0f} s")
    return str(run_dir / "sft_model")


def grpo(args, start: str, data: Path, run_dir: Path, prm: Path | None) -> list[dict]:
    argv = [
        "train",
        f"model.path={start}",
        f"data.train_files=[{data / 'train.jsonl'}]",
        f"data.val_files=[{data / 'val.jsonl'}]",
        f"reward.function={chains.__file__}:final_sum_reward",
        "data.max_prompt_length=48",
        f"data.max_response_length={args.response_length}",
        f"trainer.total_steps={args.steps}",
        f"trainer.test_freq={args.test_freq}",
        "trainer.save_freq=0",
        f"trainer.run_dir={run_dir}",
        "trainer.loggers=[jsonl]",
        *args.extra,
    ]
    if prm is not None:
        argv += [
            "reward.prm.enable=true",
            f"reward.prm.path={prm}",
            f"reward.prm.reduction={args.reduction}",
            f"reward.prm.weight={args.prm_weight}",
        ]
    print(f"GRPO ({'outcome + PRM' if prm else 'outcome'}): {run(argv):.0f} s")
    return read_metrics(run_dir / "metrics.jsonl")


def val_curve(rows: list[dict]) -> dict[int, float]:
    """Held-out accuracy by step: validation scores with the rule only, PRM or not."""
    return {r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prm", type=Path, required=True, help="the PRM directory (prm_demo's prm/reward_model)")
    ap.add_argument(
        "--run-dir", type=Path, default=None, help="where the runs go (default: a temporary folder)"
    )
    ap.add_argument("--terms", type=int, default=4, help="numbers per problem (as the PRM's chains)")
    ap.add_argument("--max-operand", type=int, default=9)
    ap.add_argument("--response-length", type=int, default=32)
    ap.add_argument("--val", type=int, default=256, help="held-out problems")
    ap.add_argument("--policy-sft-steps", type=int, default=160)
    ap.add_argument(
        "--policy-start", default=None, help="reuse this start (a model directory) instead of an SFT"
    )
    ap.add_argument(
        "--arm",
        choices=("both", "outcome", "prm"),
        default="both",
        help="run one GRPO arm (two shells: in parallel)",
    )
    ap.add_argument("--steps", type=int, default=40, help="GRPO steps of each run")
    ap.add_argument("--test-freq", type=int, default=5)
    ap.add_argument("--reduction", default="mean", help="reward.prm.reduction (min, mean, last)")
    ap.add_argument("--prm-weight", type=float, default=1.0)
    ap.add_argument("extra", nargs="*", help="more overrides for both GRPO runs")
    args = ap.parse_args()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="prm-grpo-demo-"))
    data = run_dir / "problems"
    write_problems(args, data)
    start = args.policy_start or policy_start(args, data, run_dir / "policy_start")
    curves = {}
    if args.arm in ("both", "outcome"):
        curves["outcome"] = val_curve(grpo(args, start, data, run_dir / "outcome", None))
    if args.arm in ("both", "prm"):
        curves[f"outcome + PRM {args.reduction}"] = val_curve(
            grpo(args, start, data, run_dir / "prm", args.prm.resolve())
        )
    print(
        f"held-out accuracy (the outcome rule) by GRPO step\n{'step':>5} "
        + " ".join(f"{k:>22}" for k in curves)
    )
    for step in sorted(next(iter(curves.values()))):
        print(f"{step:>5} " + " ".join(f"{c.get(step, float('nan')):>22.3f}" for c in curves.values()))
    print(f"runs in {run_dir}")


if __name__ == "__main__":
    main()
