"""The cost of a step with a distillation teacher against the same GRPO step with a reference model.

Run::

    python3 benchmarks/distill_step_cost.py              # the three shapes below, ~10 minutes on one core
    python3 benchmarks/distill_step_cost.py --help       # shapes, rounds, steps, threads

On-policy distillation replaces the reference forward with the teacher's: with a KL term off, a step with a
teacher of the student's size should cost about what a GRPO step with a KL term (a reference pass) costs. The
goal is a ratio within 1.15x. The script times, at each shape of ``benchmarks/grpo_step_vs_trl.py`` (its
``posttrain_config``: prompts x samples per prompt x response token limit, random tiny Qwen2 weights so nearly
every response runs to the limit, one optimizer step per rollout, fp32):

- ``grpo + KL (reference)``: ``actor.use_kl_loss=true``, the reference pass on every step;
- ``opd (teacher)``: ``algorithm.adv_estimator=opd``, no KL, the teacher pass instead;
- ``grpo + opd_coef (teacher)``: GRPO's advantages plus the OPD term (``distill.opd_coef=1``), no KL;
- ``opd (teacher), bypass``: ``opd`` with ``algorithm.rollout_correction.bypass_mode=true``: the engine's
  log-probs serve as the student's, so no old-log-prob pass runs. The OPD term needs the student's log-probs
  before the update; with one optimizer step per rollout the GRPO variant has no such pass (the update's own
  forward gives them), so without bypass the teacher variants run one forward more than the reference variant.

The teacher is another tiny Qwen2 of the student's shape and tokenizer (other random weights). Each round runs
each variant in a fresh Python process (one untimed warm-up step, then ``--steps`` timed ones), the variants
alternating so load from other jobs hits them alike. Printed: each variant's median step in CPU seconds of its
process (one thread: the work done, even when other jobs take the core part of the time; wall seconds with
more threads), its ratio to the reference variant, and the mean wall seconds of the reference and teacher
phases (``timing/ref``, ``timing/teacher``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_step_vs_trl import parse_shape, run_posttrain  # noqa: E402

from posttrain.models.tiny import create_tiny_model_dir  # noqa: E402
from posttrain.utils.console import print_table  # noqa: E402

REFERENCE = "grpo + KL (reference)"
VARIANTS = {  # name -> overrides; "{teacher}" is the teacher's directory
    REFERENCE: ["actor.use_kl_loss=true", "actor.kl_loss_coef=0.001"],
    "opd (teacher)": ["algorithm.adv_estimator=opd", "distill.teacher.path={teacher}"],
    "grpo + opd_coef (teacher)": ["distill.opd_coef=1.0", "distill.teacher.path={teacher}"],
    # The engine's log-probs as the student's (no old-log-prob pass: the OPD term needs the student's log-probs
    # before the update, which the GRPO variant takes from the update's own forward)
    "opd (teacher), bypass": [
        "algorithm.adv_estimator=opd",
        "distill.teacher.path={teacher}",
        "algorithm.rollout_correction.bypass_mode=true",
    ],
}
WORKER_ARGS = ("prompts", "n", "max_tokens", "optimizer_steps", "lr", "steps", "threads", "model")


def run_isolated(args: argparse.Namespace, model_dir: Path, extra: list[str], seed: int) -> tuple[list, dict]:
    """One round of one variant in a fresh Python process (this script with ``--worker``)."""
    job = {name: getattr(args, name) for name in WORKER_ARGS}
    job.update(seed=seed, extra=extra, model_dir=str(model_dir))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True, env=env
    )
    if done.returncode:
        raise RuntimeError(f"the worker failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return [tuple(t) for t in result["times"]], result["phases"]


def worker(job: dict) -> None:
    """The ``--worker`` process: one round, its step times and phases printed as one JSON line."""
    args = argparse.Namespace(**{name: job[name] for name in WORKER_ARGS})
    torch.set_num_threads(args.threads)
    times, phases = run_posttrain(args, Path(job["model_dir"]), job["seed"], job["extra"])
    print(json.dumps({"times": times, "phases": phases}))


def time_shape(args: argparse.Namespace, model_dir: Path, teacher_dir: Path) -> list[dict]:
    """Alternating rounds of every variant at one shape; one table row per variant."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    phases: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for round_ in range(args.rounds):
        for name, extra in VARIANTS.items():
            extra = [e.format(teacher=teacher_dir) for e in extra]
            step_times, step_phases = run_isolated(args, model_dir, extra, round_)
            times[name] += step_times
            phases[name].append(step_phases)
            print(
                f"  round {round_ + 1}: {name} (wall, CPU) s {[tuple(round(x, 2) for x in t) for t in step_times]}"
            )
    clock = 1 if args.threads == 1 else 0
    medians = {name: statistics.median(t[clock] for t in ts) for name, ts in times.items()}
    return [
        {
            "shape": f"{args.prompts}x{args.n}x{args.max_tokens}",
            "variant": name,
            f"median {'CPU' if clock else 'wall'} s/step": round(medians[name], 3),
            "x reference variant": round(medians[name] / medians[REFERENCE], 3),
            "ref pass s": round(statistics.mean(p.get("timing/ref", 0.0) for p in phases[name]), 3),
            "old-log-prob pass s": round(
                statistics.mean(p.get("timing/old_log_prob", 0.0) for p in phases[name]), 3
            ),
            "teacher pass s": round(statistics.mean(p.get("timing/teacher", 0.0) for p in phases[name]), 3),
            "steps timed": len(ts),
        }
        for name, ts in times.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", type=parse_shape, nargs="+", default=[(8, 8, 32), (16, 4, 32), (8, 8, 128)]
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round (after one warm-up step)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one round in a fresh process
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    args.optimizer_steps, args.lr, args.model = 1, 1e-5, "random"
    print("command: python3 " + " ".join(sys.argv))
    print(
        f"torch {torch.__version__}, {args.threads} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}; load average at start: {os.getloadavg()}"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_tiny_model_dir(Path(tmp) / "student", seed=0)
        teacher_dir = create_tiny_model_dir(Path(tmp) / "teacher", seed=1)
        for prompts, n, tokens in args.shapes:
            args.prompts, args.n, args.max_tokens = prompts, n, tokens
            print(f"\n== shape {prompts}x{n}x{tokens}")
            rows += time_shape(args, model_dir, teacher_dir)
    print()
    print_table(
        f"Step cost with a teacher vs with a reference: {args.rounds} alternating rounds x {args.steps} steps, "
        f"tiny Qwen2 (random weights) fp32, CPU capability {torch.backends.cpu.get_cpu_capability()}; goal <= 1.15x",
        rows,
    )
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
