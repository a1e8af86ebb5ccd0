"""One GRPO step, head to head: TRL's ``GRPOTrainer`` vs posttrain's ``train_step``, on CPU, at equal work.

Run::

    pip install "posttrain[bench]"          # or: pip install trl==1.16.0 (TRL is never a runtime dependency)
    python3 benchmarks/grpo_step_vs_trl.py  # the three shapes below, ~15 minutes on one core; --help for options

By default it times three shapes, ``--shapes 8x8x32 16x4x32 8x8x128`` (prompts x samples per prompt x response
token limit), with random weights (``--model random``: nearly every response runs to the limit) and one
optimizer step per rollout, and ends with a summary: each trainer's median step, the speed-up at posttrain's
defaults, and the step's FLOP floor at this machine's measured matmul rate (below).

A *step* is one rollout and the optimizer steps trained on it. Both trainers get:

- the same model and tokenizer: the built-in tiny Qwen2 (``posttrain.models.tiny``: hidden 256, 4 layers, 4 heads,
  2 KV heads, intermediate 768, vocabulary 512), warm-started or random (``--model``), in a local directory both
  load (fp32, sdpa attention, no gradient checkpointing: TRL with ``use_cpu=True, bf16=False,
  gradient_checkpointing=False``);
- the same prompts: the built-in arithmetic task's training problems (``posttrain.data.tasks.arithmetic``) through
  the same chat template, and the same reward (posttrain's ``arithmetic_reward``, wrapped for TRL);
- the same work per step: ``prompts`` prompts x ``n`` samples, at most ``max-tokens`` response tokens (one
  ``--shapes`` entry each), temperature 1, no top-k/top-p; ``--optimizer-steps`` AdamW steps per rollout
  (default 1; the built-in job's shape is ``--shapes 32x8x8 --optimizer-steps 2 --model builtin``) on equal shares of
  the samples, each as one forward/backward micro-batch; old log-probs recomputed once per rollout when the
  samples serve more than one optimizer step, and by neither trainer with ``--optimizer-steps 1`` (TRL then
  takes them from the update's own forward, and posttrain's plan does the same); no reference model, no KL term (TRL ``beta=0``,
  posttrain ``actor.use_kl_loss=false``); token-mean loss over the mini-batch (TRL ``loss_type="dapo"``),
  PPO clip 0.2, group-normalised advantages (TRL ``scale_rewards="group"``), learning rate ``--lr`` constant with
  no warm-up, gradient clipping at 1.0.

TRL's round is ``benchmarks/trl_grpo_step.py``. Its knobs for this: ``num_generations=n``,
``per_device_train_batch_size=prompts*n/optimizer_steps``,
``gradient_accumulation_steps=1``, ``steps_per_generation=optimizer_steps`` (so TRL generates
``prompts*n`` completions at once and recomputes their old log-probs, as posttrain does), ``num_iterations=1``.
A TRL "step" is one optimizer step, so a posttrain step is compared with ``optimizer_steps`` consecutive TRL
steps starting at a generation.

Differences that could not be removed: the two sample with different random streams, so responses (and their
lengths, printed) differ; with ``--model random`` untrained weights rarely emit eos, so nearly every response
runs to ``--max-tokens`` on both sides. posttrain keeps a prompt's samples in one mini-batch and TRL shuffles
samples across its two optimizer steps (same amount of work). posttrain's dual-clip (``actor.clip_ratio_c``) has no TRL counterpart
(a clamp; negligible compute).

posttrain runs in the variants of ``VARIANTS`` (``--variants``): its defaults (which include the prefix grouper
whenever ``rollout.n`` > 1); verl's padded layout (``actor.use_prefix_grouper=false``, the previous default); and
the defaults with ``algorithm.rollout_correction.bypass_mode`` (the engine's log-probs serve as the old
log-probs, which matters only with several optimizer steps per rollout). All compute the same quantities
(tests/forward/test_prefix_grouper.py, tests/rl/test_throughput_options.py). ``--model builtin`` uses the model
``posttrain train`` trains (the tiny Qwen2 after its SFT warm start: short answers, then eos).

The FLOP floor of a step is the matrix-multiply work no trainer can skip, timed at the rate this process
measures for a ``[4096, hidden] x [hidden, intermediate]`` fp32 product (the fastest of 30): ``2 N T_roll`` for the rollout and
``6 N T_upd`` for the update's forward and backward, with ``N`` the model's matrix parameters (linear layers and
the LM head) and ``T`` = each prompt once plus every response token (posttrain's mean response length);
attention, norms and sampling are left out, so the floor is below what any implementation can reach. The summary
also gives posttrain's rollout and update phases (wall seconds) against their own floors: how near the native
engine's decode loop is to the matmul floor at each response length.

Each round builds a fresh trainer of each kind in its own Python process (nothing carried over from the other
trainer: allocator state, caches, threads), runs one untimed warm-up step, then ``--steps`` timed steps;
rounds alternate (TRL, posttrain, TRL, ...) so that load from other processes hits both alike. Each process is
what its users get: posttrain's applies ``trainer.tune_malloc`` (glibc keeps freed memory for the next step) as
``posttrain train`` does on CPU, and TRL's changes nothing. The variant ``posttrain, glibc malloc defaults``
shows that setting's share, and ``--trl-kept-memory`` also times TRL in a process with the same setting. Printed: the
median step time of each (CPU seconds of the process and wall seconds), the phases of posttrain's step (wall),
and the ratio, of CPU times with one thread (they measure the work done even when other jobs take the core
away part of the time) and of wall times otherwise. ``--threads`` defaults to 1: the
project's 2-core machine is shared with other jobs, and with 2 threads under that load both trainers ran about
8x slower and erratically (on an idle machine use ``--threads 2``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trl_grpo_step import run_trl  # noqa: E402

from posttrain.config.load import build_config  # noqa: E402
from posttrain.data.splits import load_splits
from posttrain.models.tiny import create_tiny_model_dir  # noqa: E402
from posttrain.parallel.runtime import select_device  # noqa: E402
from posttrain.rl.build import build_components  # noqa: E402
from posttrain.rl.step import train_step  # noqa: E402
from posttrain.sft.builtin import builtin_model_dir  # noqa: E402
from posttrain.utils.allocator import keep_freed_memory_for_cpu_training  # noqa: E402
from posttrain.utils.console import print_table  # noqa: E402
from posttrain.utils.metrics import PhaseTimer  # noqa: E402
from posttrain.utils.seed import seed_everything  # noqa: E402

# posttrain variants timed against TRL: name -> extra config overrides. Every variant computes the same
# quantities (tests/models/test_prefix_grouper.py, tests/rl/test_throughput_options.py).
VARIANTS = {
    "posttrain": [],
    "posttrain, verl's padded layout": ["actor.use_prefix_grouper=false"],
    "posttrain +bypass": ["algorithm.rollout_correction.bypass_mode=true"],
    "posttrain, glibc malloc defaults": ["trainer.tune_malloc=false"],
}
DEFAULTS = "posttrain"
TRL = "TRL GRPOTrainer"
TRL_KEPT_MEMORY = "TRL, posttrain's malloc policy"
# What a worker process needs from the command line (the rest of its job: trainer, seed, overrides, model).
WORKER_ARGS = ("prompts", "n", "max_tokens", "optimizer_steps", "lr", "steps", "threads", "model")


def posttrain_config(args: argparse.Namespace, model_dir: Path, run_dir: Path, extra: list[str] = ()):
    samples = args.prompts * args.n
    return build_config(
        overrides=[
            f"model.path={model_dir}",
            "model.dtype=fp32",
            "data.task=arithmetic",
            f"data.train_batch_size={args.prompts}",
            f"rollout.n={args.n}",
            f"data.max_response_length={args.max_tokens}",
            "rollout.temperature=1.0",
            f"actor.ppo_mini_batch_size={args.prompts // args.optimizer_steps}",
            f"actor.ppo_micro_batch_size_per_gpu={samples // args.optimizer_steps}",
            f"actor.log_prob_micro_batch_size_per_gpu={samples // args.optimizer_steps}",
            "actor.ppo_epochs=1",
            "actor.use_kl_loss=false",
            "actor.entropy_coeff=0.0",
            "actor.loss_agg_mode=token-mean",
            "actor.clip_ratio_low=0.2",
            "actor.clip_ratio_high=0.2",
            f"actor.optim.lr={args.lr}",
            "actor.optim.lr_schedule=constant",
            "actor.optim.warmup_steps=0",
            "actor.optim.weight_decay=0.0",
            "actor.optim.grad_clip=1.0",
            "algorithm.adv_estimator=grpo",
            "trainer.device=cpu",
            f"trainer.total_steps={args.steps + 1}",
            "trainer.test_freq=0",
            f"trainer.run_dir={run_dir}",
            *extra,
        ]
    )


def run_posttrain(
    args: argparse.Namespace, model_dir: Path, seed: int, extra: list[str]
) -> tuple[list[tuple[float, float]], dict[str, float]]:
    """Warm-up step + ``args.steps`` timed steps; returns (wall, CPU) seconds per step and mean phase times."""
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = posttrain_config(args, model_dir, Path(run_dir), extra)
        cfg.trainer.seed = seed
        keep_freed_memory_for_cpu_training(
            cfg.trainer.tune_malloc, select_device(cfg)
        )  # as `posttrain train`
        seed_everything(seed)
        run = build_components(cfg, quiet=True)
        timer = PhaseTimer()
        times, phases, lengths = [], {}, []
        try:
            for step in range(1, args.steps + 2):
                start, cpu = time.perf_counter(), time.process_time()
                metrics = train_step(run, step, timer)
                elapsed = (time.perf_counter() - start, time.process_time() - cpu)
                if step == 1:
                    continue
                times.append(elapsed)
                lengths.append(metrics["response_length/mean"])
                for key, value in metrics.items():
                    if key.startswith("timing/") and key != "timing/step":
                        phases[key] = phases.get(key, 0.0) + value / args.steps
        finally:
            run.close()
    phases["response_length/mean"] = statistics.mean(lengths)
    return times, phases


def matmul_rate(hidden: int, intermediate: int, repeats: int = 30) -> float:
    """Peak FLOP/s of a ``[4096, hidden] x [hidden, intermediate]`` fp32 product on this process's threads: the
    fastest of ``repeats`` runs, in CPU seconds with one thread (other jobs cannot make it look slower) and wall
    seconds otherwise."""
    a, b = torch.randn(4096, hidden), torch.randn(hidden, intermediate)
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        a @ b
        best = min(best, clock() - start)
    return 2 * 4096 * hidden * intermediate / best


def flop_floor(
    model_dir: Path, prompts: int, n: int, prompt_len: float, response_len: float
) -> tuple[float, float]:
    """Matrix-multiply FLOPs of one step's rollout and update that no trainer can skip (module docstring)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    kv = c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    layer = c.hidden_size * (2 * c.hidden_size + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    params = c.num_hidden_layers * layer + c.vocab_size * c.hidden_size  # + the LM head
    tokens = prompts * prompt_len + prompts * n * response_len
    return 2 * params * tokens, 6 * params * tokens


def mean_prompt_tokens(cfg, model_dir: Path) -> float:
    """Mean length of the chat-formatted training prompts, in tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = load_splits(cfg).train
    lengths = [
        len(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": r.prompt}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for r in records
    ]
    return statistics.mean(lengths)


def run_isolated(
    args: argparse.Namespace, model_dir: Path, trainer: str, seed: int, extra: list[str] = ()
) -> tuple[list[tuple[float, float]], dict[str, float]]:
    """One round of one trainer in a fresh Python process (this script with ``--worker``): no allocator state,
    caches or threads carried over from the other trainer, and each process is what its users get (posttrain
    applies ``trainer.tune_malloc`` as ``posttrain train`` does; TRL changes nothing)."""
    job = {name: getattr(args, name) for name in WORKER_ARGS}
    job.update(trainer=trainer, seed=seed, extra=list(extra), model_dir=str(model_dir))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True, env=env
    )
    if done.returncode:
        raise RuntimeError(f"the {trainer} worker failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return [tuple(t) for t in result["times"]], result["phases"]


def worker(job: dict) -> None:
    """The ``--worker`` process: run one round and print its times and phases as one JSON line."""
    args = argparse.Namespace(**{name: job[name] for name in WORKER_ARGS})
    torch.set_num_threads(args.threads)
    model_dir = Path(job["model_dir"])
    if job["trainer"] in (TRL, TRL_KEPT_MEMORY):
        if job["trainer"] == TRL_KEPT_MEMORY:
            keep_freed_memory_for_cpu_training(True, torch.device("cpu"))
        records = load_splits(posttrain_config(args, model_dir, Path(tempfile.gettempdir()))).train
        times, phases = run_trl(args, records, model_dir, job["seed"]), {}
    else:
        times, phases = run_posttrain(args, model_dir, job["seed"], job["extra"])
    print(json.dumps({"times": times, "phases": phases}))


def time_shape(args: argparse.Namespace, model_dir: Path, variants: dict[str, list[str]]) -> dict:
    """Alternating rounds of TRL and each posttrain variant at one shape; prints its tables, returns medians."""
    trls = [TRL, TRL_KEPT_MEMORY] if args.trl_kept_memory else [TRL]
    times: dict[str, list[tuple[float, float]]] = {
        **{name: [] for name in trls},
        **{name: [] for name in variants},
    }
    phases: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        for name in [*trls, *variants]:
            step_times, step_phases = run_isolated(args, model_dir, name, round_, variants.get(name, []))
            times[name] += step_times
            if name in variants:
                phases[name].append(step_phases)
            shown = [tuple(round(x, 2) for x in t) for t in step_times]
            print(f"  round {round_ + 1}: {name} (wall, CPU) s {shown}")
    # CPU seconds of the process measure the work done even when other jobs take the cores away part of the
    # time (one thread: CPU time = wall time on an idle machine); with several threads only wall time is fair.
    clock = 1 if args.threads == 1 else 0
    medians = {name: statistics.median(t[clock] for t in ts) for name, ts in times.items()}
    reference = medians[TRL]
    rows = [
        {
            "trainer": name,
            "median CPU s/step": round(statistics.median(t[1] for t in ts), 3),
            "median wall s/step": round(statistics.median(t[0] for t in ts), 3),
            "min-max wall s": f"{min(t[0] for t in ts):.2f}-{max(t[0] for t in ts):.2f}",
            "steps timed": len(ts),
            "speed-up vs TRL": round(reference / medians[name], 2),
        }
        for name, ts in times.items()
    ]
    print()
    print_table(
        f"GRPO step: {args.prompts} prompts x n={args.n}, <= {args.max_tokens} response tokens, "
        f"{args.optimizer_steps} optimizer steps per rollout, tiny Qwen2 ({args.model} weights) fp32, "
        f"{args.threads} CPU threads; speed-up from {'CPU' if clock else 'wall'} time",
        rows,
    )
    # Phases in order of first appearance over every variant; one that did not run (the old-log-prob pass
    # with one optimizer step, or in bypass mode) is shown as 0.
    keys = list(dict.fromkeys(k for runs in phases.values() for p in runs for k in p))
    phase_rows = []
    for name, runs in phases.items():
        mean = {
            k.removeprefix("timing/"): round(statistics.mean(p.get(k, 0.0) for p in runs), 3) for k in keys
        }
        phase_rows.append({"variant": name, **mean})
    print_table("posttrain step phases (mean wall seconds)", phase_rows)
    response_len = statistics.mean(p["response_length/mean"] for runs in phases.values() for p in runs)
    defaults = {k: statistics.mean(p.get(k, 0.0) for p in phases[DEFAULTS]) for k in keys}
    return {"medians": medians, "response_len": response_len, "phases": defaults}


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        prompts, n, tokens = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: write PROMPTSxNxTOKENS, e.g. 8x8x32") from None
    return prompts, n, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes",
        type=parse_shape,
        nargs="+",
        default=[(8, 8, 32), (16, 4, 32), (8, 8, 128)],
        help="PROMPTSxNxTOKENS: prompts per step x samples per prompt x response token limit",
    )
    parser.add_argument("--optimizer-steps", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round (after one warm-up step)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--model",
        choices=("builtin", "random"),
        default="random",
        help="random: the tiny Qwen2 with random weights (nearly every response runs to the token limit); "
        "builtin: the built-in job's warm-started model (answers, then stops: short, ragged responses)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=sorted(VARIANTS),
        default=list(VARIANTS),
        help="posttrain configurations to time (each against the same TRL runs)",
    )
    parser.add_argument(
        "--trl-kept-memory",
        action="store_true",
        help=f"also time {TRL_KEPT_MEMORY!r}: TRL in a process with posttrain's trainer.tune_malloc policy",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one round in a fresh process
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if DEFAULTS not in args.variants:
        parser.error(f"--variants must include {DEFAULTS!r} (the summary compares the defaults)")
    for prompts, _, _ in args.shapes:
        if prompts % args.optimizer_steps:
            parser.error(f"prompts ({prompts}) must be a multiple of --optimizer-steps")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print("command: python3 " + " ".join(sys.argv))
    print(
        f"torch {torch.__version__}, {args.threads} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}; load average at start: {os.getloadavg()}"
    )
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "builtin":
            # The model `posttrain train` trains by default: the tiny Qwen2 after its SFT warm start (cached).
            model_dir = builtin_model_dir(build_config(overrides=[]))
        else:
            model_dir = create_tiny_model_dir(Path(tmp) / "tiny", seed=0)
        print(f"model: {args.model} ({model_dir.name})")
        variants = {name: VARIANTS[name] for name in args.variants}
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(model_dir)
        rate = matmul_rate(hf.hidden_size, hf.intermediate_size)
        print(f"measured matmul rate: {rate / 1e9:.1f} GFLOP/s")
        for prompts, n, tokens in args.shapes:
            args.prompts, args.n, args.max_tokens = prompts, n, tokens
            print(f"\n== shape {prompts}x{n}x{tokens}")
            result = time_shape(args, model_dir, variants)
            prompt_len = mean_prompt_tokens(posttrain_config(args, model_dir, Path(tmp)), model_dir)
            rollout_flops, update_flops = flop_floor(
                model_dir, prompts, n, prompt_len, result["response_len"]
            )
            floor = (rollout_flops + update_flops) / rate
            m, ph = result["medians"], result["phases"]
            summary.append(
                {
                    "shape": f"{prompts}x{n}x{tokens}",
                    "prompt / response tokens": f"{prompt_len:.1f} / {result['response_len']:.1f}",
                    "TRL s": round(m[TRL], 3),
                    "posttrain s": round(m[DEFAULTS], 3),
                    "speed-up": round(m[TRL] / m[DEFAULTS], 2),
                    "FLOP floor s": round(floor, 3),
                    "TRL x floor": round(m[TRL] / floor, 1),
                    "posttrain x floor": round(m[DEFAULTS] / floor, 1),
                    "its rollout x floor": round(ph["timing/rollout"] / (rollout_flops / rate), 1),
                    "its update x floor": round(ph["timing/update_actor"] / (update_flops / rate), 1),
                }
            )
    print()
    print(
        "shape: prompts x samples per prompt x response token limit; posttrain at its defaults; x floor: the time"
    )
    print("over the step's matmul FLOP floor (its rollout / update: those phases over their own floors)")
    print_table(
        f"Summary: median {'CPU' if args.threads == 1 else 'wall'} seconds per step, {args.rounds} alternating "
        f"rounds x {args.steps} steps, {args.model} weights, {args.optimizer_steps} optimizer step(s) per rollout, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, matmul {rate / 1e9:.1f} GFLOP/s",
        summary,
    )
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
