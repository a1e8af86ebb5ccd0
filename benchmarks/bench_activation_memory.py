"""Peak memory of one actor training micro-batch, forward + backward, with and without gradient checkpointing.

Run: ``python benchmarks/bench_activation_memory.py`` (about eight minutes on 2 CPU cores: 12 child processes).

Setting: a Qwen2 with hidden 512, 8 layers, 8 heads (4 KV heads), intermediate 1408 and a 32,000-token
vocabulary (random weights, fp32, sdpa attention; 56 M parameters); one micro-batch of ``--rows`` sequences of
``--seq-len`` tokens (a quarter prompt, the rest response). The loss is the trainer's own actor loss
(``engine.roles.actor_loss_fn``: PPO clip + entropy bonus + KL loss) with the forward options and module
preparation built from a config by ``posttrain.models.prepare``, exactly as ``posttrain train`` does.

Variants (config keys):

* ``baseline``: nothing on.
* ``gradient checkpointing``: ``model.enable_gradient_checkpointing=true``.
* ``chunked head``: ``actor.entropy_from_logits_with_chunking=true actor.entropy_checkpointing=true`` (chunks of
  2,048 tokens): the ``[tokens, vocab]`` logits are never kept for backward.
* ``gradient checkpointing + chunked head``: both.

Measurement: every variant and repeat runs in a fresh child process, variants alternated. On CPU the child
records its peak resident set size (``ru_maxrss``) after building the model and batch, pre-allocating the
parameter gradients (model state any trainer holds) and a 2-token warm-up forward, then again after forward +
backward: the growth is the working memory of the step. On CUDA it uses ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.algorithms.aggregation import LossNormalizer  # noqa: E402
from posttrain.config.load import build_config  # noqa: E402
from posttrain.data.batch import build_rollout_batch  # noqa: E402
from posttrain.forward.options import pass_options
from posttrain.models.prepare import prepare_policy
from posttrain.train.losses import actor_loss_fn

VARIANTS = {
    "baseline": [],
    "gradient checkpointing": ["model.enable_gradient_checkpointing=true"],
    "chunked head": ["actor.entropy_from_logits_with_chunking=true", "actor.entropy_checkpointing=true"],
    "gradient checkpointing + chunked head": [
        "model.enable_gradient_checkpointing=true",
        "actor.entropy_from_logits_with_chunking=true",
        "actor.entropy_checkpointing=true",
    ],
}


def _peak_rss_bytes() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is KiB on Linux, bytes on macOS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _memory_mark(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _peak_rss_bytes()


def child(args: argparse.Namespace) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = build_config(overrides=VARIANTS[args.variant])
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa").float().to(device)
    prepare_policy(model, cfg)
    model.train()
    options = pass_options(cfg, device).actor
    g = torch.Generator().manual_seed(1)
    prompt = args.seq_len // 4
    ids = [torch.randint(0, args.vocab, (args.seq_len,), generator=g).tolist() for _ in range(args.rows)]
    batch = build_rollout_batch([s[:prompt] for s in ids], [s[prompt:] for s in ids], [0] * args.rows, 0)
    mask = batch.response_mask
    batch.old_log_probs = -torch.rand(mask.shape, generator=g) * 10 * mask
    batch.ref_log_probs = batch.old_log_probs + 0.1 * torch.randn(mask.shape, generator=g) * mask
    batch.advantages = torch.randn(mask.shape, generator=g) * mask
    batch = batch.to(device)
    loss_fn = actor_loss_fn(model, cfg.actor, 1.0, options)
    normalizer = LossNormalizer.from_mask(batch.response_mask, norm_constant=batch.response_width)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with torch.no_grad():  # warm up lazy initialisation (thread pools, kernels) outside the measurement
        model(input_ids=batch.input_ids[:1, :2], use_cache=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = _memory_mark(device)
    start = time.perf_counter()
    loss, _ = loss_fn(batch, normalizer)
    loss.backward()
    after = _memory_mark(device)
    seconds = time.perf_counter() - start
    print(json.dumps({"growth": after - before, "seconds": seconds, "loss": float(loss.detach())}))


def run_child(args: argparse.Namespace, variant: str) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--variant",
        variant,
        "--rows",
        str(args.rows),
        "--seq-len",
        str(args.seq_len),
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
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="baseline", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print("command: python " + " ".join(sys.argv))
    tokens = args.rows * args.seq_len
    print(
        f"settings: Qwen2 hidden 512, 8 layers, vocab {args.vocab}, fp32, sdpa; micro-batch {args.rows} x "
        f"{args.seq_len} = {tokens} tokens; device={args.device}, threads={args.threads}, torch {torch.__version__}"
    )
    print(f"load average at start (1/5/15 min): {os.getloadavg()}\n")
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for rep in range(args.repeats):
        for variant in VARIANTS:  # alternated, so machine load hits every variant alike
            res = run_child(args, variant)
            results[variant].append(res)
            print(
                f"  run {rep + 1}: {variant}: {res['growth'] / 2**20:.0f} MiB in {res['seconds']:.1f} s",
                flush=True,
            )
    base = statistics.median(r["growth"] for r in results["baseline"])
    base_s = statistics.median(r["seconds"] for r in results["baseline"])
    header = ["variant", "peak growth MiB (min-max)", "vs baseline", "fwd+bwd s", "time vs baseline", "loss"]
    rows = []
    for variant, runs in results.items():
        mib = [r["growth"] / 2**20 for r in runs]
        secs = statistics.median(r["seconds"] for r in runs)
        growth = statistics.median(r["growth"] for r in runs)
        rows.append(
            [
                variant,
                f"{statistics.median(mib):,.0f} ({min(mib):,.0f}-{max(mib):,.0f})",
                f"{growth / base:.2f}x",
                f"{secs:.1f}",
                f"{secs / base_s:.2f}x",
                f"{runs[0]['loss']:.6f}",
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print()
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print(f"\nmedian of {args.repeats} runs per variant; load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
