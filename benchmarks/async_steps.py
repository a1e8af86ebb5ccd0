"""Synchronous steps vs rollouts ahead of training (``async_training``), on CPU: step time and samples/s.

Run::

    python3 benchmarks/async_steps.py                 # the built-in job's shape, then long responses (~10 min)
    python3 benchmarks/async_steps.py --help

Each variant builds a fresh trainer (``posttrain.rl.build.build_components``) and runs ``--steps`` steps of
the built-in arithmetic task through ``posttrain.rl.step.train_step`` (no validation, no checkpoints); the
first ``--warmup`` steps are not timed (with rollouts ahead, step 1 waits for its whole rollout). Variants:

- ``sync, 1 thread``: rollout and training alternate, torch on one thread;
- ``sync, 2 threads``: the same with two torch threads (the machine's two cores for every phase);
- ``ahead k, 1+1 threads``: ``async_training.enable=true, max_staleness=k``: the rollout thread and the
  trainer each run torch on one thread, so the two cores work on different phases at once.
- ``ahead 1, Ray worker, 1+1 processes``: the same schedule with the rollout worker in a process of its own
  that Ray places on one CPU (``async_training.rollout_worker=ray``; needs ``posttrain[ray]``); the worker's
  start (Ray, its engine) is before the timed steps. Weights travel through Ray's object store every step.

Rounds alternate the variants so that load from other jobs hits them alike; the table gives medians over all
timed steps. The phase table gives the synchronous run's mean phase times, from which the last table models
what separate rollout devices would give (a model, not a measurement: see docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.config.load import build_config  # noqa: E402
from posttrain.models.tiny import create_tiny_model_dir  # noqa: E402
from posttrain.rl.build import build_components  # noqa: E402
from posttrain.rl.step import train_step  # noqa: E402
from posttrain.rl.train_command import rollout_source  # noqa: E402
from posttrain.sft.builtin import builtin_model_dir  # noqa: E402
from posttrain.utils.console import print_table  # noqa: E402
from posttrain.utils.metrics import PhaseTimer  # noqa: E402
from posttrain.utils.seed import seed_everything  # noqa: E402

SHAPES = {
    # name: (model, overrides)
    "built-in job (32 prompts x 8, <= 8 tokens)": ("builtin", []),
    "long responses (8 prompts x 8, <= 64 tokens, random weights)": (
        "random",
        [
            "data.train_batch_size=8",
            "data.max_response_length=64",
            "actor.ppo_mini_batch_size=4",
            "actor.ppo_micro_batch_size_per_gpu=32",
            "actor.log_prob_micro_batch_size_per_gpu=64",
        ],
    ),
}
VARIANTS = {
    "sync, 1 thread": (1, []),
    "sync, 2 threads": (2, []),
    "ahead 1, 1+1 threads": (1, ["async_training.enable=true", "async_training.max_staleness=1"]),
    "ahead 2, 1+1 threads": (1, ["async_training.enable=true", "async_training.max_staleness=2"]),
    "ahead 1, Ray worker, 1+1 processes": (
        1,
        ["async_training.enable=true", "async_training.max_staleness=1", "async_training.rollout_worker=ray"],
    ),
}


def run_variant(model_dir: Path, shape: list[str], extra: list[str], threads: int, args) -> tuple[list, dict]:
    """Per-step wall seconds of the timed steps, and the mean phase seconds."""
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = build_config(
            overrides=[
                f"model.path={model_dir}",
                "data.task=arithmetic",
                f"trainer.total_steps={args.steps}",
                "trainer.test_freq=0",
                f"trainer.run_dir={run_dir}",
                *shape,
                *extra,
            ]
        )
        seed_everything(cfg.trainer.seed)
        run = build_components(cfg, quiet=True)
        source = rollout_source(run, 0)
        timer, times, phases, samples = PhaseTimer(), [], {}, cfg.data.train_batch_size * cfg.rollout.n
        try:
            for step in range(1, args.steps + 1):
                start = time.perf_counter()
                metrics = train_step(run, step, timer, source)
                if step > args.warmup:
                    times.append(time.perf_counter() - start)
                    for key, value in metrics.items():
                        if key.startswith("timing/") and key != "timing/step":
                            phases[key] = phases.get(key, 0.0) + value / (args.steps - args.warmup)
        finally:
            source.close()
            run.close()
    phases["samples"] = samples
    return times, phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--shapes", nargs="+", choices=range(len(SHAPES)), type=int, default=list(range(len(SHAPES)))
    )
    args = parser.parse_args()
    print("command: python3 " + " ".join(sys.argv))
    print(f"torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        for index in args.shapes:
            title, (model, shape) = list(SHAPES.items())[index]
            if model == "builtin":
                model_dir = builtin_model_dir(build_config(overrides=[]))
            else:
                model_dir = create_tiny_model_dir(Path(tmp) / "tiny", seed=0)
            times: dict[str, list[float]] = {name: [] for name in VARIANTS}
            phases: dict[str, dict] = {}
            for _ in range(args.rounds):
                for name, (threads, extra) in VARIANTS.items():
                    ts, ph = run_variant(model_dir, shape, extra, threads, args)
                    times[name] += ts
                    phases.setdefault(name, ph)
            samples = phases["sync, 1 thread"]["samples"]
            base = statistics.median(times["sync, 1 thread"])
            print()
            print_table(
                f"{title}: median wall seconds per step over {args.rounds} rounds x {args.steps - args.warmup} "
                "timed steps",
                [
                    {
                        "variant": name,
                        "s/step": round(statistics.median(ts), 3),
                        "min-max s": f"{min(ts):.2f}-{max(ts):.2f}",
                        "samples/s": round(samples / statistics.median(ts), 1),
                        "speed-up vs sync 1 thread": round(base / statistics.median(ts), 2),
                    }
                    for name, ts in times.items()
                ],
            )
            sync = phases["sync, 1 thread"]
            rollout = sync.get("timing/rollout", 0.0)
            train = sum(v for k, v in sync.items() if k.startswith("timing/") and k != "timing/rollout")
            print_table(
                "Model, not a measurement: rollout on separate devices of the same speed (sync, 1 thread phases)",
                [
                    {
                        "rollout s": round(rollout, 3),
                        "rest of the step s": round(train, 3),
                        "sync step s": round(rollout + train, 3),
                        "overlapped step s = max": round(max(rollout, train), 3),
                        "modelled speed-up": round((rollout + train) / max(rollout, train, 1e-9), 2),
                    }
                ],
            )


if __name__ == "__main__":
    main()
