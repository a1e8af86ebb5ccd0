"""Remove-padding benchmark: compute-token overhead and training throughput, padded vs packed.

Run: ``python benchmarks/bench_packing.py`` (about two minutes on 2 CPU cores).

Part 1 (no model): for ``--n`` RL-like sequences (prompt 50-300 tokens + lognormal response capped at
1024), the positions a forward pass computes divided by the valid tokens, for padded layouts (whole batch,
fixed micro-batches, token-budget micro-batches padded to their own longest sequence) and packed layouts
(one row per micro-batch, the flash-attention layout; rows bounded for CPU attention). ``attn cells`` is
``rows * row_len^2`` summed over micro-batches, what dense attention computes per layer and head.

Part 2 (tiny Qwen2, fp32, hidden 256, 4 layers): optimizer steps (forward + backward + AdamW) on the same
batches, padded (right padding + attention mask) vs packed (``pack_sequences`` + ``packed_causal_lm_forward``),
timed in ``--repeats`` runs with the variants alternated; valid training tokens per second, median (min-max).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.batching.packing import compute_tokens, pack_sequences  # noqa: E402
from posttrain.batching.token_budget import plan_token_micro_batches  # noqa: E402
from posttrain.forward.packed import packed_causal_lm_forward  # noqa: E402


def rl_lengths(rng: random.Random, n: int, prompt: tuple[int, int], mu: float, cap: int) -> list[int]:
    return [rng.randint(*prompt) + min(cap, int(rng.lognormvariate(mu, 1.0))) for _ in range(n)]


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    print(fmt(header))
    print(fmt(["-" * w for w in widths]))
    for r in rows:
        print(fmt(r))
    print()


def overhead_table(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    lens = rl_lengths(rng, args.n, (50, 300), 5.5, 1024)
    max_len = 300 + 1024
    budget = args.budget_factor * max_len
    plan = plan_token_micro_batches(lens, budget)
    fixed = [
        list(range(s, min(s + args.micro_batch_size, len(lens))))
        for s in range(0, len(lens), args.micro_batch_size)
    ]

    def total(groups: list[list[int]], **kw) -> tuple[int, int, int]:
        counts = [compute_tokens([lens[i] for i in g], **kw) for g in groups]
        return (sum(c.computed_tokens for c in counts), sum(c.attention_cells for c in counts), len(groups))

    layouts = [
        ("padded, whole batch to its longest", total([list(range(len(lens)))], layout="padded")),
        (f"padded, micro-batches of {args.micro_batch_size}", total(fixed, layout="padded")),
        ("padded, token-budget micro-batches", total(plan, layout="padded")),
        ("packed, token-budget micro-batches, 1 row each", total(plan, layout="packed")),
    ]
    for row_tokens in args.row_tokens:
        layouts.append(
            (
                f"packed, token-budget micro-batches, rows <= {row_tokens}",
                total(plan, layout="packed", max_row_tokens=row_tokens),
            )
        )
    valid = sum(lens)
    base_cells = layouts[0][1][1]
    rows = [
        [
            name,
            str(n_groups),
            f"{computed:,}",
            f"{valid:,}",
            f"{computed / valid:.4f}",
            f"{cells / base_cells:.3f}",
        ]
        for name, (computed, cells, n_groups) in layouts
    ]
    print(
        f"## Compute-token overhead: {args.n} sequences, {valid:,} valid tokens, budget {budget} tokens "
        f"per micro-batch ({len(plan)} micro-batches)\n"
    )
    print_table(["layout", "micro-batches", "computed", "valid", "computed/valid", "attn cells (rel.)"], rows)


def tiny_qwen2(vocab: int, attn: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).float().train()


def padded_loss(model, seqs: list[torch.Tensor]) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
        labels[i, : len(s) - 1] = s[1:]
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def packed_loss(model, seqs: list[torch.Tensor], row_tokens: int | None) -> torch.Tensor:
    packed = pack_sequences(seqs, row_tokens)
    labels = packed.next_token_labels()
    logits = packed_causal_lm_forward(model, packed)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def train_step(opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def throughput_table(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    vocab = 352
    rng = random.Random(1)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.steps):
        lens = rl_lengths(rng, args.train_batch, (16, 64), 4.2, 256)
        batches.append([torch.randint(1, vocab, (n,), generator=g) for n in lens])
    valid_per_run = sum(len(s) for b in batches for s in b)
    model = tiny_qwen2(vocab, args.attn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    with torch.no_grad():  # the layouts compute the same function: same loss for the same weights
        diff = abs(float(padded_loss(model, batches[0])) - float(packed_loss(model, batches[0], None)))
    variants = {"padded (attention mask)": lambda b: train_step(opt, padded_loss(model, b))}
    for row_tokens in args.train_row_tokens:
        variants[f"packed, rows <= {row_tokens}"] = lambda b, r=row_tokens: train_step(
            opt, packed_loss(model, b, r)
        )
    variants["packed, one row"] = lambda b: train_step(opt, packed_loss(model, b, None))
    for fn in variants.values():  # warm-up (allocator, kernels)
        fn(batches[0])
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():  # alternate variants so drift hits all equally
            start = time.perf_counter()
            for b in batches:
                fn(b)
            times[name].append(time.perf_counter() - start)
    computed = {"padded (attention mask)": sum(len(b) * max(len(s) for s in b) for b in batches)}
    for row_tokens in args.train_row_tokens:
        computed[f"packed, rows <= {row_tokens}"] = sum(
            compute_tokens([len(s) for s in b], max_row_tokens=row_tokens).computed_tokens for b in batches
        )
    computed["packed, one row"] = valid_per_run
    base = statistics.median(times["padded (attention mask)"])
    rows = []
    for name, ts in times.items():
        tps = [valid_per_run / t for t in ts]
        rows.append(
            [
                name,
                f"{computed[name] / valid_per_run:.3f}",
                f"{statistics.median(ts) / args.steps * 1000:.0f}",
                f"{statistics.median(tps):,.0f} ({min(tps):,.0f}-{max(tps):,.0f})",
                f"{base / statistics.median(ts):.2f}x",
            ]
        )
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"## Training throughput, tiny Qwen2 ({n_params / 1e6:.1f} M params, fp32, {args.attn}, {args.threads} threads): "
        f"{args.steps} steps of {args.train_batch} sequences ({valid_per_run / args.steps:,.0f} valid tokens/step), "
        f"median of {args.repeats} alternated runs\n"
    )
    print_table(["layout", "computed/valid", "ms/step", "valid tokens/s (min-max)", "speed-up"], rows)
    print(f"|loss padded - loss packed| on the first batch, same weights: {diff:.2e}\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=256, help="sequences in the overhead table")
    parser.add_argument(
        "--budget-factor", type=int, default=3, help="token budget = factor x max sequence length"
    )
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--row-tokens", type=int, nargs="*", default=[1536, 2048])
    parser.add_argument("--train-batch", type=int, default=24, help="sequences per optimizer step")
    parser.add_argument("--train-row-tokens", type=int, nargs="*", default=[512])
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant (median reported)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--skip-train", action="store_true", help="only the overhead table")
    args = parser.parse_args()
    print("command: python " + " ".join(sys.argv))
    print(f"settings: {vars(args)}  torch {torch.__version__}")
    print(f"load average at start (1/5/15 min): {os.getloadavg()}\n")
    overhead_table(args)
    if not args.skip_train:
        throughput_table(args)
        print(f"load average at end (1/5/15 min): {os.getloadavg()}")


if __name__ == "__main__":
    main()
