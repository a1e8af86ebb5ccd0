"""Generation alone: posttrain's rollout engine vs Hugging Face ``model.generate`` on the same prompts.

Run: ``python3 benchmarks/rollout_vs_hf_generate.py`` (a few minutes on 2 CPU cores; ``--help`` for options).

Model: the built-in tiny Qwen2 (``posttrain.models.tiny``: hidden 256, 4 layers, 4 heads, 2 KV heads,
intermediate 768, byte-level BPE vocabulary of 512), fp32, built locally: random weights from seed 0
(``--model random``, the default), or the built-in job's model after its SFT warm start (``--model builtin``;
it answers in a few tokens and stops, like the responses of its RL steps).
Prompts: 64 problems of the built-in arithmetic task through the chat template (16-18 tokens), n = 8 samples
each, so 512 samples per run.

Both sides sample at temperature 1 with no top-k/top-p, stop on the model's eos ids (``<|im_end|>``,
``<|endoftext|>``) and generate at most ``--max-tokens`` tokens per sample:

- **HF generate**: the 64 prompts each repeated 8 times, left-padded into one [512, L] batch (what a trainer
  without its own engine does), ``do_sample=True, top_k=0, top_p=1.0``, default (sdpa) attention.
- **posttrain**: ``NativeEngine`` with the config defaults (``rollout.max_num_seqs`` etc., read from the schema),
  ``SamplingParams(n=8)``: each prompt prefilled once, continuous batching over the slot KV cache.

Untrained weights rarely emit eos (about 2 in 512 tokens), so in the fixed-length rows (``--max-tokens``) most
samples run to the limit on both sides: equal generated tokens. RL responses end at very different lengths,
which is where continuous batching matters (HF ``generate`` keeps computing finished rows until the longest one
ends); the ragged rows (``--ragged-max-tokens``) emulate that by adding ``--ragged-eos`` more token ids (the
vocabulary's last ids, same list on both sides) to the eos set, so a sample ends with probability about 1/16 per
token. tokens/s counts each side's own generated tokens (eos included, padding excluded).

One untimed warm-up run each, then ``--repeats`` runs alternated (HF, posttrain, HF, ...) so that load from other
processes hits both alike; the table shows medians of CPU seconds (of this process) and wall seconds, and the
ratio of the median times: CPU time with one thread (it measures the work done even when other jobs take the
core away part of the time; on an idle machine it equals wall time), wall time otherwise. ``--threads`` defaults to
1: the project's 2-core machine is shared with other jobs, and 2-thread OpenMP under oversubscription ran up to
8x slower and erratic (on an idle machine use ``--threads 2``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.config.load import build_config  # noqa: E402
from posttrain.config.schema import RolloutConfig  # noqa: E402
from posttrain.data.datasets import tokenize_prompts  # noqa: E402
from posttrain.data.tasks.arithmetic import make_arithmetic_splits  # noqa: E402
from posttrain.models.hf import load_causal_lm, load_tokenizer  # noqa: E402
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from posttrain.rollout.base import SamplingParams  # noqa: E402
from posttrain.rollout.native.engine import NativeEngine, left_pad  # noqa: E402
from posttrain.sft.builtin import builtin_model_dir  # noqa: E402
from posttrain.utils.console import print_table  # noqa: E402


def hf_generate(model, prompts: list[list[int]], n: int, max_tokens: int, eos: list[int], pad: int) -> int:
    """One HF ``generate`` over the left-padded, n-times repeated prompts; returns generated tokens."""
    ids, mask = left_pad([p for p in prompts for _ in range(n)], pad, torch.device("cpu"))
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    new = out[:, ids.shape[1] :]
    # A row's tokens run up to and including its first eos; after it HF writes padding.
    is_eos = torch.isin(new, torch.tensor(eos))
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0
    return int((~after_eos).sum())


def matmul_bound(model: torch.nn.Module, rows: int, repeats: int = 20) -> tuple[float, float]:
    """(GFLOP of matrix multiplies per generated token, tokens/s of a decode step that did nothing but those
    multiplies): every ``nn.Linear`` of the model (LM head included) timed here as ``[rows, in] @ [in, out]``.
    No engine can decode faster than this on this machine at this batch size and dtype."""
    shapes = [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    seconds: dict[tuple[int, int], float] = {}
    for out_features, in_features in set(shapes):
        x, w = torch.randn(rows, in_features), torch.randn(in_features, out_features)
        for _ in range(3):
            x @ w
        start = time.perf_counter()
        for _ in range(repeats):
            x @ w
        seconds[(out_features, in_features)] = (time.perf_counter() - start) / repeats
    flops = 2 * sum(o * i for o, i in shapes)
    return flops / 1e9, rows / sum(seconds[s] for s in shapes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--ragged-max-tokens", type=int, nargs="*", default=[128])
    parser.add_argument("--ragged-eos", type=int, default=30, help="extra eos ids in the ragged rows")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--model",
        choices=("random", "builtin"),
        default="random",
        help="random: untrained weights (samples rarely stop); builtin: the built-in job's warm-started model "
        "(answers, then stops: short, ragged responses, as in its RL steps)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=RolloutConfig.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=RolloutConfig.max_num_batched_tokens)
    parser.add_argument(
        "--compile", action="store_true", help="also time the engine with enforce_eager=False"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("command: python3 " + " ".join(sys.argv))
    print(f"torch {torch.__version__}, {args.threads} threads; load average at start: {os.getloadavg()}")

    if args.model == "builtin":
        # The model `posttrain train` trains by default: the tiny Qwen2 after its SFT warm start (cached).
        model_dir = builtin_model_dir(build_config(overrides=[]))
        tokenizer, model = load_tokenizer(model_dir), load_causal_lm(model_dir).eval()
    else:
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_model(tokenizer, seed=0)
    print(f"model: {args.model} weights")
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    pad = tokenizer.pad_token_id
    records, _ = make_arithmetic_splits(seed=0, n_train=args.prompts, n_val=0, max_operand=19)
    prompts = tokenize_prompts(records, tokenizer, max_prompt_length=64).prompt_ids
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens x n={args.n}")
    variants = {"posttrain": dict(enforce_eager=True)}
    if args.compile:
        variants["posttrain (compiled decode)"] = dict(enforce_eager=False)
    print(f"engine: max_num_seqs={args.max_num_seqs}, max_num_batched_tokens={args.max_num_batched_tokens}\n")

    decode_rows = min(args.max_num_seqs, len(prompts) * args.n)
    gflop, bound = matmul_bound(model, decode_rows)
    print(
        f"matrix multiplies: {gflop * 1e3:.2f} MFLOP per generated token; at the speed measured here for "
        f"{decode_rows} rows ({gflop * bound:.0f} GFLOP/s) a decode step of nothing else would reach "
        f"{bound:,.0f} tokens/s (the '% of matmul bound' column)\n"
    )
    extra_eos = list(range(len(tokenizer) - args.ragged_eos, len(tokenizer)))
    scenarios = [(t, eos) for t in args.max_tokens] + [(t, eos + extra_eos) for t in args.ragged_max_tokens]
    rows = []
    for max_tokens, stop in scenarios:
        engines = {
            name: NativeEngine(
                model,
                stop,
                pad,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                **kw,
            )
            for name, kw in variants.items()
        }

        def run_hf(seed: int, max_tokens: int = max_tokens, stop: list[int] = stop) -> int:
            torch.manual_seed(seed)
            return hf_generate(model, prompts, args.n, max_tokens, stop, pad)

        runners = {"HF generate": run_hf}
        for name, engine in engines.items():

            def run_engine(seed: int, engine: NativeEngine = engine, max_tokens: int = max_tokens) -> int:
                params = SamplingParams(max_tokens=max_tokens, n=args.n, seed=seed)
                return sum(engine.generate(prompts, params).response_lengths)

            runners[name] = run_engine
        times: dict[str, list[float]] = {name: [] for name in runners}  # wall seconds
        cpu: dict[str, list[float]] = {name: [] for name in runners}  # CPU seconds of this process
        tokens: dict[str, list[int]] = {name: [] for name in runners}
        for fn in runners.values():
            fn(10_000)  # warm-up (and compilation, when on)
        for rep in range(args.repeats):
            for name, fn in runners.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                tokens[name].append(fn(rep))
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
                label = f"max_tokens {max_tokens}, {len(stop)} eos ids, run {rep + 1}: {name}"
                print(
                    f"  {label}: {times[name][-1]:.3f} s wall, {cpu[name][-1]:.3f} s CPU, {tokens[name][-1]} tokens",
                    flush=True,
                )
        # CPU seconds measure the work done even when other jobs take the core away part of the time (one
        # thread: CPU time = wall time on an idle machine); with several threads only wall time is fair.
        clock = cpu if args.threads == 1 else times
        reference = statistics.median(clock["HF generate"])
        for name in runners:
            t = statistics.median(clock[name])
            rows.append(
                {
                    "max tokens": max_tokens,
                    "eos ids": len(stop),
                    "engine": name,
                    "median CPU s": round(statistics.median(cpu[name]), 3),
                    "median wall s": round(statistics.median(times[name]), 3),
                    "generated tokens": int(statistics.median(tokens[name])),
                    "tokens/s": round(statistics.median(tokens[name]) / t),
                    "speed-up vs HF": round(reference / t, 2),
                    "% of matmul bound": round(100 * statistics.median(tokens[name]) / t / bound),
                }
            )
    print()
    print_table(
        f"{len(prompts)} prompts x n={args.n}, tiny Qwen2 ({args.model} weights) fp32, {args.threads} CPU "
        f"threads, median of "
        f"{args.repeats} alternated runs; tokens/s and speed-up from {'CPU' if args.threads == 1 else 'wall'} time",
        rows,
    )
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
