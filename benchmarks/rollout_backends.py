"""Rollout backends side by side: the native engine vs the vLLM engine, generation tokens/s and weight-sync time.

Run (in the environment with vLLM, one thread, in-process engine):
``OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/rollout_backends.py``
(``--help`` for options). Prints a markdown table.

Model: the built-in tiny Qwen2 shape (``posttrain.models.tiny``: hidden 256, 4 layers, 4 heads of size 64, 2 KV
heads, intermediate 768, tied embeddings), random weights from seed 0, fp32, saved to a temporary directory that
both engines read. Prompts: ``--prompts`` texts of the built-in tokenizer's corpus (8-20 tokens), n samples each,
temperature 1, no top-k/top-p, stop on the model's eos ids (random weights rarely emit them, so most samples run
to max_tokens on both sides: equal work).

Shapes (prompts x n x max_tokens) from ``--shapes``: short and long responses. Both engines get the same
``max_num_seqs`` (every sample at once) and token budget; vLLM runs with chunked prefill off (required on CPU
with per-request seeds) and an explicit KV cache of max_num_seqs x max_model_len tokens.

Sync: the full state_dict pushed into each engine (native: ``own_copy=True``, a tensor copy per weight; vLLM:
buckets of whole fused groups through the worker's in-place reload, then a prefix-cache reset).

One untimed warm-up per engine and shape, then ``--repeats`` runs alternated (native, vLLM, native, ...); the
table shows medians of wall seconds, tokens/s computed from them, and the ratio. Quote numbers with the machine
they came from.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer, tiny_corpus  # noqa: E402
from posttrain.rollout.base import SamplingParams  # noqa: E402
from posttrain.rollout.native.engine import NativeEngine
from posttrain.rollout.vllm.engine import VLLMEngine
from posttrain.rollout.vllm.knobs import VLLMKnobs


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shapes", default="16x4x16,16x4x128,4x4x384", help="prompts x n x max_tokens, comma-separated"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs per engine and shape (medians reported)"
    )
    p.add_argument("--sync-repeats", type=int, default=5, help="timed weight syncs per engine")
    return p.parse_args()


def cpu_name() -> str:
    """The CPU's model name as lscpu reports it (the platform's processor string otherwise)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")
        )
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)  # the built-in tiny shape, tied embeddings
    eos = list(model.generation_config.eos_token_id)
    corpus = [tokenizer.encode(t) for t in tiny_corpus()]
    corpus = [ids for ids in corpus if 8 <= len(ids) <= 20]
    max_seqs = max(p * n for p, n, _ in shapes)
    max_len = max(t for _, _, t in shapes) + 32
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        native = NativeEngine(
            model,
            eos,
            tokenizer.pad_token_id,
            chunk_size=64,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max(2048, max_len),
            own_copy=True,
        )
        knobs = VLLMKnobs(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max(2048, max_len),
            max_model_len=max_len,
            load_format="auto",
            bucket_bytes=512 << 20,
        )
        start = time.perf_counter()
        vllm_engine = VLLMEngine(tmp, eos, dtype="fp32", seed=0, device="cpu", knobs=knobs)
        print(
            f"vLLM engine built in {time.perf_counter() - start:.1f} s (vllm imported inside)",
            file=sys.stderr,
        )
        rows = []
        for prompts_n, n, max_tokens in shapes:
            prompts = corpus[:prompts_n]
            params = SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0, seed=1)
            times: dict[str, list[float]] = {"native": [], "vllm": []}
            tokens: dict[str, int] = {}
            engines = {"native": native, "vllm": vllm_engine}
            for name, engine in engines.items():  # warm-up
                tokens[name] = sum(engine.generate(prompts, params).response_lengths)
            for _ in range(args.repeats):
                for name, engine in engines.items():
                    seconds, _ = timed(lambda e=engine, p=prompts, s=params: e.generate(p, s))
                    times[name].append(seconds)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append(
                {
                    "shape (prompts x n x max_tokens)": f"{prompts_n} x {n} x {max_tokens}",
                    "tokens (native / vLLM)": f"{tokens['native']} / {tokens['vllm']}",
                    "native s": f"{med['native']:.2f}",
                    "vLLM s": f"{med['vllm']:.2f}",
                    "native tok/s": f"{tokens['native'] / med['native']:.0f}",
                    "vLLM tok/s": f"{tokens['vllm'] / med['vllm']:.0f}",
                    "vLLM / native tok/s": f"{(tokens['vllm'] / med['vllm']) / (tokens['native'] / med['native']):.2f}",
                }
            )
        state = model.state_dict()
        sync = {"native": [], "vllm": []}
        for _ in range(args.sync_repeats):
            sync["native"].append(timed(lambda: native.sync_weights(state.items()))[0])
            vllm_engine.sync_weights(state.items())
            sync["vllm"].append(vllm_engine.sync_metrics()["rollout/sync_s"])
        megabytes = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    print(
        f"\nMachine: {cpu_name()}, {os.cpu_count()} logical CPUs, torch threads 1; medians of {args.repeats} "
        f"alternating runs after a warm-up.\n"
    )
    header = list(rows[0])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row[h] for h in header) + " |")
    print(
        f"\nFull weight sync ({megabytes:.1f} MiB fp32, median of {args.sync_repeats}): native "
        f"{statistics.median(sync['native']) * 1e3:.1f} ms, vLLM {statistics.median(sync['vllm']) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
