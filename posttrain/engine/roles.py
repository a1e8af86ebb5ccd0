"""The trainable roles: optimizer + schedule, the actor's and critic's losses, their updates."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from posttrain.algorithms.aggregation import LossNormalizer, aggregate_loss
from posttrain.algorithms.kl import kl_penalty
from posttrain.algorithms.masked import masked_mean
from posttrain.algorithms.policy_loss import get_policy_loss
from posttrain.algorithms.value_loss import compute_value_loss
from posttrain.config.plan import UpdatePlan
from posttrain.config.schema import ActorConfig, CriticConfig, OptimConfig
from posttrain.data.batch import RolloutBatch
from posttrain.engine.micro_batches import (
    SINGLE_RANK,
    DataParallel,
    LossFn,
    LossShare,
    accumulate_and_step,
    iter_mini_batches,
    rank_micro_batches,
)
from posttrain.models.forward import DEFAULT_OPTIONS, ForwardOptions, critic_values, policy_logprobs


def lr_lambda(optim: OptimConfig, total_steps: int):
    """Multiplier of the peak lr at optimizer step s: linear warm-up, then constant/cosine/linear decay."""

    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.lr_schedule == "constant":
            return 1.0
        span = max(1, total_steps - optim.warmup_steps)
        progress = min(1.0, (step - optim.warmup_steps) / span)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if optim.lr_schedule == "cosine" else 1 - progress
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * shape

    return factor


@dataclass
class Trainable:
    """A module with its optimizer and schedule (one per trained role)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    grad_clip: float

    @classmethod
    def create(cls, module: nn.Module, optim: OptimConfig, total_optimizer_steps: int) -> Trainable:
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim, total_optimizer_steps))
        return cls(module, optimizer, scheduler, optim.grad_clip)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


def actor_loss_fn(
    model: nn.Module, cfg: ActorConfig, temperature: float, options: ForwardOptions = DEFAULT_OPTIONS
) -> LossFn:
    """Policy loss − entropy bonus + KL loss for one micro-batch (global normalizer).

    ``options`` says how the forward runs (packing, chunked head, activation offload); never what it computes.
    """
    policy_loss = get_policy_loss(cfg.policy_loss)

    def loss_fn(mb: RolloutBatch, normalizer: LossNormalizer):
        logprobs, entropy = policy_logprobs(
            model, mb, temperature=temperature, with_entropy=True, options=options
        )
        mask = mb.response_mask
        loss, metrics = policy_loss(
            old_log_prob=mb.old_log_probs, log_prob=logprobs, advantages=mb.advantages, response_mask=mask,
            clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
            normalizer=normalizer, loss_agg_mode=cfg.loss_agg_mode,
        )  # fmt: skip
        metrics = {f"actor/{k}": v for k, v in metrics.items()}
        metrics["actor/pg_loss"] = LossShare(loss.detach())  # a share of the mini-batch loss: summed
        if cfg.entropy_coeff != 0:
            loss = loss - cfg.entropy_coeff * aggregate_loss(entropy, mask, cfg.loss_agg_mode, normalizer)
        metrics["actor/entropy"] = masked_mean(entropy.detach(), mask)
        if cfg.use_kl_loss:
            kl = kl_penalty(logprobs, mb.ref_log_probs, cfg.kl_loss_type)
            kl_loss = aggregate_loss(kl, mask, cfg.loss_agg_mode, normalizer)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = masked_mean(kl.detach(), mask)
        return loss, metrics

    return loss_fn


def critic_loss_fn(critic: nn.Module, cfg: CriticConfig, options: ForwardOptions = DEFAULT_OPTIONS) -> LossFn:
    """Clipped value loss for one micro-batch (global normalizer); ``options`` as for the actor."""

    def loss_fn(mb: RolloutBatch, normalizer: LossNormalizer):
        vpreds = critic_values(critic, mb, options)
        loss, metrics = compute_value_loss(
            vpreds=vpreds, returns=mb.returns, values=mb.values, response_mask=mb.response_mask,
            cliprange_value=cfg.cliprange_value, normalizer=normalizer, loss_agg_mode=cfg.loss_agg_mode,
        )  # fmt: skip
        out = {f"critic/{k}": v for k, v in metrics.items()}
        out["critic/vpred_mean"] = masked_mean(vpreds.detach(), mb.response_mask)
        return loss, out

    return loss_fn


def run_update(
    trainable: Trainable,
    batch: RolloutBatch,
    plan: UpdatePlan,
    loss_fn: LossFn,
    *,
    shuffle: bool,
    norm_constant: float,
    generator: torch.Generator,
    prefix: str,
    dp: DataParallel = SINGLE_RANK,
) -> dict[str, float]:
    """ppo_epochs × mini-batches × micro-batches for one role; returns metrics averaged over steps.

    Every rank sees the same mini-batches (same generator); each runs its share of every mini-batch.
    """
    trainable.module.train()
    per_step: list[dict[str, float]] = []
    budget = plan.max_token_len_per_rank if plan.use_dynamic_bsz else None
    for _epoch, mini in iter_mini_batches(batch, plan.mini_batch_prompts, plan.ppo_epochs, shuffle, generator):
        normalizer = LossNormalizer.from_mask(mini.response_mask, norm_constant, dp_size=dp.grad_ranks)
        _, rows = rank_micro_batches(mini, dp, plan.micro_batch_size_per_rank, budget)
        per_step.append(
            accumulate_and_step(
                trainable.module, trainable.optimizer, trainable.scheduler, mini, rows, loss_fn, normalizer,
                trainable.grad_clip, dp,
            )  # fmt: skip
        )
    keys = {k for m in per_step for k in m}
    out = {k if "/" in k else f"{prefix}/{k}": sum(m.get(k, 0.0) for m in per_step) / len(per_step) for k in keys}
    out[f"{prefix}/lr"] = trainable.lr
    out[f"{prefix}/optimizer_steps"] = float(len(per_step))
    return out
