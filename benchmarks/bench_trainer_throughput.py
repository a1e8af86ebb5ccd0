"""Actor-update throughput through the trainer's own code: padded vs packed, fixed vs token-budget micro-batches.

Run: ``python benchmarks/bench_trainer_throughput.py`` (about two minutes on 2 CPU cores).

Unlike part 2 of ``bench_packing.py`` (a bare forward/backward loop), this times ``engine.roles.run_update`` with
``actor_loss_fn`` (PPO clip + entropy bonus + KL loss, AdamW step) on a rollout-like ``RolloutBatch``: left-padded
prompts of 20-120 tokens and right-padded responses of lognormal length capped at 256 (8 prompts x 4 samples),
with the batch plan and forward options built from a config exactly as ``posttrain train`` builds them
(``config.plan.build_plan`` and ``trainers.throughput.pass_options``). Model: the tiny Qwen2 of the platform notes
(hidden 256, 4 layers, 4 heads, 2 KV heads, intermediate 768, vocab 512), fp32, sdpa, random weights.

After one untimed warm-up step per variant, each variant runs ``--steps`` optimizer steps on the same batch from the same initial weights, ``--repeats`` times
with the variants alternated; reported: valid (prompt + response) training tokens per second, median (min-max),
and the first step's mini-batch loss (identical across variants: only the layout changes).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.config.load import build_config  # noqa: E402
from posttrain.config.plan import build_plan  # noqa: E402
from posttrain.data.batch import RolloutBatch, build_rollout_batch  # noqa: E402
from posttrain.forward.options import pass_options
from posttrain.train.losses import actor_loss_fn
from posttrain.train.trainable import Trainable
from posttrain.train.update import run_update

BASE = [
    "data.train_batch_size=8",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=8",
    "data.max_prompt_length=128",
    "data.max_response_length=256",
    "actor.use_kl_loss=true",
    "actor.entropy_coeff=0.01",
    "actor.optim.lr=1e-4",
]


def variants(budget: int, row_tokens: int) -> dict[str, list[str]]:
    packed = ["model.use_remove_padding=true", f"model.remove_padding_max_row_tokens={row_tokens}"]
    dynamic = ["actor.use_dynamic_bsz=true", f"actor.ppo_max_token_len_per_gpu={budget}"]
    return {
        "padded, micro-batches of 8": ["actor.ppo_micro_batch_size_per_gpu=8"],
        f"padded, token budget {budget}": dynamic,
        f"packed rows <= {row_tokens}, micro-batches of 8": [*packed, "actor.ppo_micro_batch_size_per_gpu=8"],
        f"packed rows <= {row_tokens}, token budget {budget}": [*packed, *dynamic],
    }


def rollout_like_batch(seed: int, vocab: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(8):
        prompt = torch.randint(
            3, vocab, (int(torch.randint(20, 121, (1,), generator=g)),), generator=g
        ).tolist()
        for _sample in range(4):
            n = min(256, max(1, int(torch.empty(1).log_normal_(4.0, 1.0, generator=g))))
            prompts.append(prompt)
            responses.append(torch.randint(3, vocab, (n,), generator=g).tolist())
    batch = build_rollout_batch(prompts, responses, [i // 4 for i in range(32)], pad_token_id=0)
    mask = batch.response_mask
    batch.old_log_probs = -torch.rand(mask.shape, generator=g) * 6 * mask
    batch.ref_log_probs = batch.old_log_probs + 0.1 * torch.randn(mask.shape, generator=g) * mask
    batch.advantages = torch.randn(mask.shape, generator=g) * mask
    return batch


def run(
    model0: torch.nn.Module, batch: RolloutBatch, overrides: list[str], steps: int
) -> tuple[float, float]:
    cfg = build_config(overrides=[*BASE, *overrides])
    plan = build_plan(cfg).actor
    options = pass_options(cfg, torch.device("cpu")).actor
    model = copy.deepcopy(model0)
    trainable = Trainable.create(model, cfg.actor.optim, steps)
    loss_fn = actor_loss_fn(model, cfg.actor, 1.0, options)
    first_loss = float("nan")
    start = time.perf_counter()
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        metrics = run_update(
            trainable, batch, plan, loss_fn, shuffle=False, norm_constant=256.0, generator=gen, prefix="actor"
        )
        if step == 0:
            first_loss = metrics["actor/loss"]
    return time.perf_counter() - start, first_loss


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--row-tokens", type=int, default=512)
    args = parser.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    model0 = Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa").float()
    batch = rollout_like_batch(1, config.vocab_size)
    valid = int(batch.attention_mask.sum())
    print("command: python " + " ".join(sys.argv))
    print(
        f"batch: 32 samples, {valid:,} valid tokens, padded to {batch.input_ids.shape[1]} columns "
        f"({batch.input_ids.numel():,} positions, {batch.input_ids.numel() / valid:.2f}x valid); "
        f"{args.steps} optimizer steps per run; threads={args.threads}, torch {torch.__version__}"
    )
    print(f"load average at start (1/5/15 min): {os.getloadavg()}\n")
    table = variants(args.budget, args.row_tokens)
    times: dict[str, list[float]] = {name: [] for name in table}
    losses: dict[str, float] = {}
    for overrides in table.values():  # untimed: the first call of each shape pays one-off set-up costs
        run(model0, batch, overrides, 1)
    for rep in range(args.repeats):
        for name, overrides in table.items():
            seconds, loss = run(model0, batch, overrides, args.steps)
            times[name].append(seconds)
            losses[name] = loss
            print(f"  run {rep + 1}: {name}: {seconds:.2f} s", flush=True)
    base = statistics.median(times[next(iter(table))])
    header = ["layout", "ms/step", "valid tokens/s (min-max)", "speed-up", "step-1 loss"]
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        tps = [valid * args.steps / t for t in ts]
        rows.append(
            [
                name,
                f"{1000 * med / args.steps:,.0f}",
                f"{statistics.median(tps):,.0f} ({min(tps):,.0f}-{max(tps):,.0f})",
                f"{base / med:.2f}x",
                f"{losses[name]:.7f}",
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print()
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print(f"\nmedian of {args.repeats} alternated runs; load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
