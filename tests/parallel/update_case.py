"""One role update on a fixed, seeded batch, run the same way on one process or on every rank of a job.

The batch (prompts, responses of ragged lengths, old log-probs, advantages, returns, values) is a pure
function of the seed, so every rank and the single-process reference build the same one; each rank then keeps
its share (whole prompt groups, as after a rollout) and the trainer's own code trains it. Saved: the updated
full state dict and the metrics (rank 0).
"""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.config.load import build_config
from posttrain.config.plan import build_plan
from posttrain.data.batch import build_rollout_batch
from posttrain.forward.options import pass_options
from posttrain.models.critic import CriticModel
from posttrain.models.hf import load_causal_lm
from posttrain.parallel.data_parallel import data_parallel
from posttrain.parallel.fsdp import full_state_dict, shard_model
from posttrain.parallel.runtime import init_distributed, shutdown_distributed
from posttrain.parallel.shares import data_share, select_share
from posttrain.train.losses import actor_loss_fn, critic_loss_fn
from posttrain.train.trainable import Trainable
from posttrain.train.update import run_update


def fixed_batch(seed: int, prompts: int, n: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    prompt_ids, response_ids, groups = [], [], []
    for p in range(prompts):
        prompt = torch.randint(3, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n):
            length = int(torch.randint(1, 7, (1,), generator=g))
            prompt_ids.append(prompt)
            response_ids.append(torch.randint(3, vocab, (length,), generator=g).tolist())
            groups.append(p)
    batch = build_rollout_batch(prompt_ids, response_ids, groups, pad_token_id=0)
    shape = batch.response_mask.shape
    batch.old_log_probs = -torch.rand(shape, generator=g) * 3
    batch.advantages = torch.randn(shape, generator=g)
    batch.returns = torch.randn(shape, generator=g)
    batch.values = torch.randn(shape, generator=g)
    batch.ref_log_probs = -torch.rand(shape, generator=g) * 3
    return batch


def run_update_case(out: Path, options: dict[str, str]) -> None:
    """options: model (dir), role (actor|critic), and any config overrides (dotted keys)."""
    options = dict(options)
    model_dir, role = options.pop("model"), options.pop("role", "actor")
    cfg = build_config([], [f"{k}={v}" for k, v in options.items()])
    ctx = init_distributed(torch.device("cpu"), cfg.trainer.dist_timeout_s)
    try:
        torch.manual_seed(0)
        plan = build_plan(cfg, ctx.world_size)
        if role == "actor":
            module = load_causal_lm(model_dir, "fp32", ctx.device, "sdpa")
            fsdp, optim, role_plan = cfg.actor.fsdp_config, cfg.actor.optim, plan.actor
        else:
            module = CriticModel.from_causal_lm_path(model_dir, "fp32", ctx.device, init_std=0.02)
            fsdp, optim, role_plan = cfg.critic.fsdp_config, cfg.critic.optim, plan.critic
        if ctx.distributed:
            shard_model(module, ctx, fsdp, torch.float32)
        initial = {k: v.detach().clone() for k, v in full_state_dict(module).items()}
        trainable = Trainable.create(module, optim, 10)
        opts = pass_options(cfg, ctx.device)
        if role == "actor":
            loss_fn = actor_loss_fn(module, cfg.actor, 1.0, opts.actor)
        else:
            loss_fn = critic_loss_fn(module, cfg.critic, opts.critic)
        sp = getattr(cfg, role).ulysses_sequence_parallel_size
        batch = fixed_batch(7, cfg.data.train_batch_size, cfg.rollout.n, module.config.vocab_size)
        batch = select_share(batch, data_share(ctx, sp))
        metrics = run_update(
            trainable,
            batch,
            role_plan,
            loss_fn,
            shuffle=True,
            norm_constant=8.0,
            generator=torch.Generator().manual_seed(3),
            prefix=role,
            dp=data_parallel(ctx, sp, keep_groups=cfg.actor.use_prefix_grouper and role == "actor"),
        )
        weights = {k: v.detach().clone() for k, v in full_state_dict(module).items()}
        if ctx.is_main:
            torch.save({"initial": initial, "weights": weights, "metrics": metrics}, out / "result.pt")
    finally:
        shutdown_distributed()
