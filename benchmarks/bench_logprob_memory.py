"""Peak memory of token log-probs + entropy, forward + backward: chunked/checkpointed vs full logits.

Run: ``python benchmarks/bench_logprob_memory.py`` (about five minutes on 2 CPU cores: four child processes
of 70-85 s each; the naive variant needs about 12 GB of free RAM). ``--tokens 2048`` halves time and memory.

Setting: ``N`` tokens of hidden size ``H`` (Qwen2-0.5B: 896) projected to Qwen's vocabulary (151,936),
fp32, gradients w.r.t. hidden states and the output projection, loss = mean log-prob + 0.01 mean entropy.

Measurement: each variant runs in a fresh child process (so earlier variants cannot lend it freed memory).
On CPU the child records its peak resident set size (``ru_maxrss``) after creating the inputs and
pre-allocating the projection's gradient (a parameter gradient is model state, held in any trainer), then
again after forward + backward: the growth is the working memory of the computation. Python-level tracers
do not see torch's allocations, hence the OS counter. On CUDA the child uses
``torch.cuda.max_memory_allocated`` growth instead.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.forward.chunked_head import chunked_logprobs_entropy, naive_logprobs_entropy  # noqa: E402


def _peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux (bytes on macOS)
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device).requires_grad_()
    weight = (
        (torch.randn(args.vocab, args.hidden, generator=g) * args.hidden**-0.5).to(device).requires_grad_()
    )
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    weight.grad = torch.zeros_like(weight)
    hidden.grad = torch.zeros_like(hidden)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.max_memory_allocated()
    else:
        before = _peak_rss_bytes()
    start = time.perf_counter()
    if args.variant == "naive":
        logp, ent = naive_logprobs_entropy(hidden, weight, labels)
    else:
        logp, ent = chunked_logprobs_entropy(
            hidden,
            weight,
            labels,
            chunk_size=args.chunk_size,
            checkpoint=args.variant != "chunked",
            fused=args.variant == "chunked-fused",
        )
    loss = logp.mean() + 0.01 * ent.mean()
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        after = torch.cuda.max_memory_allocated()
    else:
        after = _peak_rss_bytes()
    seconds = time.perf_counter() - start
    print(json.dumps({"growth": after - before, "seconds": seconds, "loss": float(loss)}))


def run_variant(args: argparse.Namespace, variant: str, chunk_size: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--variant",
        variant,
        "--chunk-size",
        str(chunk_size),
        "--tokens",
        str(args.tokens),
        "--hidden",
        str(args.hidden),
        "--vocab",
        str(args.vocab),
        "--threads",
        str(args.threads),
        "--device",
        args.device,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"variant {variant} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--chunk-sizes", type=int, nargs="*", default=[512])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="naive", help=argparse.SUPPRESS)
    parser.add_argument("--chunk-size", type=int, default=1024, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print("command: python " + " ".join(sys.argv))
    print(
        f"settings: N={args.tokens} tokens, H={args.hidden}, V={args.vocab}, fp32, device={args.device}, "
        f"threads={args.threads}, torch {torch.__version__}"
    )
    full = args.tokens * args.vocab * 4
    print(
        f"one [N, V] fp32 tensor = {full / 2**30:.2f} GiB; "
        f"measure = {'peak RSS growth per child process' if args.device == 'cpu' else 'max_memory_allocated growth'}"
    )
    print(f"load average at start (1/5/15 min): {os.getloadavg()}\n")
    variants = [("naive", "naive (full fp32 logits)", 0)]
    for c in args.chunk_sizes:
        variants.append(("chunked-fused", f"chunked {c}, fused recompute (default)", c))
    for c in args.chunk_sizes:
        variants.append(("chunked-ckpt", f"chunked {c}, torch.utils.checkpoint", c))
    variants.append(("chunked", f"chunked {args.chunk_sizes[0]}, no recompute", args.chunk_sizes[0]))
    results = []
    for variant, label, chunk in variants:
        res = run_variant(args, variant, chunk)
        results.append((label, res))
        print(f"  measured {label}: {res['growth'] / 2**30:.2f} GiB in {res['seconds']:.1f} s", flush=True)
    naive = results[0][1]
    print()
    header = ["variant", "peak growth (GiB)", "x [N,V] fp32", "vs naive", "fwd+bwd s", "loss"]
    rows = [
        [
            label,
            f"{r['growth'] / 2**30:.2f}",
            f"{r['growth'] / full:.2f}",
            f"{r['growth'] / naive['growth']:.3f}",
            f"{r['seconds']:.1f}",
            f"{r['loss']:.6f}",
        ]
        for label, r in results
    ]
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


if __name__ == "__main__":
    main()
