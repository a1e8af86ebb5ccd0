"""The built-in agentic tasks learn on CPU: SFT warm start on demonstrations, then GRPO, the held-out curve.

Run::

    python3 benchmarks/agent_tasks.py calculator          # or guess_number, python_arithmetic; --help for the sizes
    python3 benchmarks/agent_tasks.py guess_number --grpo-steps 20 --out /tmp/gn

For the task it runs the three commands of docs/agents.md ("Built-in tasks") as a user would, each as a
subprocess with one torch thread:

1. ``examples/agents/make_demos.py``: demonstration conversations of the task's training split;
2. ``posttrain sft`` from ``builtin:base`` on them (assistant messages only are trained on);
3. ``posttrain train`` with GRPO from the SFT model, multi-turn rollouts in the task's environment, validation on
   the held-out problems before the first step (the warm start) and every ``--test-freq`` steps.

It prints, per validation, the step, the training wall time so far, the held-out success (``val/accuracy``), the
tool-call rate and the turns per trajectory, and writes them to ``<out>/curve.json``. Timings depend on the
machine's load: run it on an idle machine for numbers to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What each task needs beyond the defaults: the lengths of its trajectories, its turns, and the run's sizes.
# calculator plays the task's default, products of two 2-digit numbers, so the model copies 4 digits into the
# tool call and 3 or 4 back: with 3- or 4-digit operands 140 SFT steps did not teach it to copy at all.
# python_arithmetic is the calculator's recipe with the python tool (the sandbox runs `print(a * b)`) and 2-digit
# operands (not the task's default 6 to 9); its prompt carries an instruction (about 40 tokens), hence the longer prompt.
TASK_OPTIONS: dict[str, dict[str, int]] = {
    "calculator": {},
    "guess_number": {},
    "python_arithmetic": {"min_digits": 2, "max_digits": 2},
}
N_TRAIN = {
    "calculator": 4000,
    "guess_number": 480,
    "python_arithmetic": 4000,
}  # data.num_train_examples; the demos use the same split
SFT = {
    "calculator": [
        "data.max_prompt_length=64",
        "data.max_response_length=192",
        # copying takes hundreds of steps; a warm-up and a cosine decay avoid the spikes of Adam at lr 1e-3
        "sft.optim.warmup_steps=10",
        "sft.optim.lr_schedule=cosine",
        "sft.optim.min_lr_ratio=0.1",
    ],
    "guess_number": ["data.max_prompt_length=96", "data.max_response_length=64"],
}
SFT["python_arithmetic"] = ["data.max_prompt_length=96", *SFT["calculator"][1:]]
GRPO = {
    "calculator": [
        "data.max_prompt_length=64",
        "data.max_response_length=192",
        "rollout.multi_turn.max_assistant_turns=3",
        "rollout.multi_turn.max_tokens_per_turn=96",
        "data.num_val_examples=128",
        "actor.ppo_mini_batch_size=8",
        # lr 2e-4: at 1e-3 (guess_number's) the warm start, whose entropy is 0.2, broke in 4 steps (reward 0)
        "actor.optim.lr=2e-4",
        "actor.optim.warmup_steps=5",
        "actor.loss_agg_mode=seq-mean-token-mean",
    ],
    # lr 1e-3 with a short warm-up and two updates per step learns in minutes; seq-mean-token-mean weighs each
    # game once (with token-mean the lost games, which have more turns, outweigh the won ones and push the
    # probability of every sampled token down: entropy rose from 0.97 to 3 and the answers turned to junk).
    "guess_number": [
        "data.max_prompt_length=96",
        "data.max_response_length=64",
        "rollout.multi_turn.max_assistant_turns=3",
        "rollout.multi_turn.max_tokens_per_turn=4",
        "data.num_val_examples=256",
        "actor.ppo_mini_batch_size=8",
        "actor.optim.lr=1e-3",
        "actor.optim.warmup_steps=5",
        "actor.loss_agg_mode=seq-mean-token-mean",
    ],
}
# Without the tool's schema block (500 tokens with the tiny tokenizer, absent from the demonstrations): with it the
# warm start called the tool in 0 of 16 held-out problems, without it in 8 of 16.
GRPO["python_arithmetic"] = [
    "data.max_prompt_length=96",
    *GRPO["calculator"][1:],
    "rollout.multi_turn.render_tools=false",
]
# The warm start: SFT steps of 32 demonstrations, and the demonstrations' imperfection (make_demos.py --rate).
# guess_number's demonstrations guess at random inside the interval the hints leave (rate 1.0): the model learns
# the format and the hints, GRPO learns to guess the middle and to stay inside the interval.
# calculator: 500 steps. After 300 the warm start copied the tool's result on one machine (held-out success 33%)
# but not on an AMD EPYC with AVX2 kernels (0.8%, loss 0.168); after 500 it did there (46.5%, loss 0.088).
SFT_STEPS = {"calculator": 500, "guess_number": 60, "python_arithmetic": 300}
GRPO_STEPS = {"calculator": 40, "guess_number": 80, "python_arithmetic": 40}
DEMO_RATE = {"calculator": None, "guess_number": 1.0, "python_arithmetic": None}
COMMON_SFT = [
    "model.path=builtin:base",
    "data.prompt_key=messages",
    "sft.response_key=",
    "sft.batch_size=32",
    "sft.micro_batch_size_per_gpu=32",
    "sft.epochs=1",
    "trainer.test_freq=0",
]
COMMON_GRPO = [
    "algorithm.adv_estimator=grpo",
    "rollout.multi_turn.enable=true",
    "data.train_batch_size=16",
    "rollout.n=8",
    "actor.ppo_micro_batch_size_per_gpu=32",
    "rollout.val_greedy=false",  # the success rate of the sampled policy, which GRPO trains
    "trainer.loggers=[console,jsonl]",
]


def run(cmd: list[str], log: Path) -> float:
    """Run ``cmd`` (output to ``log``); its wall time. A failure prints the log's end and exits."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    with log.open("w") as out:
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if code:
        sys.exit(f"{' '.join(cmd)} failed ({code}):\n{log.read_text()[-3000:]}")
    return time.monotonic() - start


def through_harness(grpo: list[str], harness: str) -> list[str]:
    """The GRPO options with the agent loop replaced by ``harness`` (file.py:function) behind the gateway. Its
    tools' schemas stay out of the prompt (harness.render_tools=false), as the task's environment leaves them
    out: the warm start never saw them."""
    own_loop = ("rollout.multi_turn.enable=", "rollout.multi_turn.max_assistant_turns=", "env.")
    kept = [o for o in grpo if not o.startswith(own_loop)]
    return [*kept, f"harness.path={harness}", "harness.render_tools=false", "harness.max_concurrent=128"]


def commands(task: str, out: Path, args) -> list[tuple[str, list[str]]]:
    py = sys.executable
    demos = out / "demos.jsonl"
    sft_steps = args.sft_steps or SFT_STEPS[task]
    rate = [] if DEMO_RATE[task] is None else [f"--rate={DEMO_RATE[task]}"]
    demo_options = [f"--option={k}={v}" for k, v in TASK_OPTIONS[task].items()]
    grpo_options = [f"data.task_options.{k}={v}" for k, v in TASK_OPTIONS[task].items()]
    grpo = [*COMMON_GRPO, *GRPO[task]]
    if args.harness:
        grpo = through_harness(grpo, args.harness)
    return [
        (
            "demos",
            [
                py,
                "examples/agents/make_demos.py",
                task,
                str(demos),
                f"--n={sft_steps * 32}",
                *rate,
                *demo_options,
                f"--n-train={N_TRAIN[task]}",
                f"--seed={args.seed}",
            ],
        ),
        (
            "sft",
            [
                py,
                "-m",
                "posttrain",
                "sft",
                *COMMON_SFT,
                *SFT[task],
                f"sft.train_files=[{demos}]",
                f"sft.max_steps={sft_steps}",
                f"trainer.seed={args.seed}",
                f"trainer.run_dir={out / 'sft'}",
            ],
        ),
        (
            "grpo",
            [
                py,
                "-m",
                "posttrain",
                "train",
                *grpo,
                f"data.task={task}",
                *grpo_options,
                f"data.num_train_examples={N_TRAIN[task]}",
                f"model.path={out / 'sft' / 'sft_model'}",
                f"trainer.total_steps={args.grpo_steps or GRPO_STEPS[task]}",
                f"trainer.test_freq={args.test_freq}",
                f"trainer.seed={args.seed}",
                f"trainer.run_dir={out / 'grpo'}",
            ],
        ),
    ]


def _first(row: dict, *names: str) -> float | None:
    for name in names:
        if name in row:
            return row[name]
    return None


def curve(metrics_file: Path) -> list[dict]:
    """One point per validation: step, training seconds so far, success, tool-call rate, turns."""
    points, seconds = [], 0.0
    for line in metrics_file.read_text().splitlines():
        row = json.loads(line)
        seconds += row.get("timing/step", 0.0)
        if "val/accuracy" in row:
            points.append(
                {
                    "step": row.get("step", 0),
                    "train_s": round(seconds, 1),
                    "success": row["val/accuracy"],
                    "tool_call_rate": _first(row, "val/tool_call_frequency", "val/tool_call_rate"),
                    "turns": _first(row, "val/num_turns_mean", "val/assistant_turns/mean"),
                }
            )
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=sorted(GRPO))
    parser.add_argument("--sft-steps", type=int, default=None, help=f"default: {SFT_STEPS}")
    parser.add_argument("--grpo-steps", type=int, default=None, help=f"default: {GRPO_STEPS}")
    parser.add_argument("--test-freq", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--harness",
        default="",
        help="roll out GRPO through this harness (file.py:function) behind the gateway instead of posttrain's agent "
        "loop, e.g. examples/agents/openai_calculator_agent.py:run",
    )
    parser.add_argument(
        "--sft-from",
        type=Path,
        default=None,
        help="reuse this run directory's SFT warm start (skip demos and SFT)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="run directory (default: a new one under /tmp)"
    )
    args = parser.parse_args()
    out = args.out or Path(f"/tmp/agent_tasks_{args.task}_{os.getpid()}")
    out.mkdir(parents=True, exist_ok=True)
    steps = commands(args.task, out, args)
    if (out / "grpo").exists():  # its checkpoints would resume an earlier run instead of starting this one
        raise SystemExit(f"--out {out} already holds a GRPO run (grpo/); name a new directory")
    if args.sft_from:  # the same warm start for a side-by-side run: link it instead of training it again
        warm = args.sft_from.resolve() / "sft"
        if not (out / "sft").exists():
            (out / "sft").symlink_to(warm)
        elif (out / "sft").resolve() != warm:
            raise SystemExit(
                f"--out {out} holds another warm start (sft/) than --sft-from's; name a new directory"
            )
        steps = steps[2:]
    for name, cmd in steps:
        print(f"{name}: {' '.join(cmd)}", flush=True)
        print(f"  {run(cmd, out / f'{name}.log'):.0f} s", flush=True)
    points = curve(out / "grpo" / "metrics.jsonl")
    print(f"{'step':>5} {'train s':>8} {'success':>8} {'tool calls':>10} {'turns':>6}")
    for p in points:
        rate = "" if p["tool_call_rate"] is None else f"{p['tool_call_rate']:.3f}"
        turns = "" if p["turns"] is None else f"{p['turns']:.2f}"
        print(f"{p['step']:>5} {p['train_s']:>8} {p['success']:>8.3f} {rate:>10} {turns:>6}")
    (out / "curve.json").write_text(json.dumps(points, indent=1))
    print(f"curve: {out / 'curve.json'}")


if __name__ == "__main__":
    main()
