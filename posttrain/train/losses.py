"""The actor's and the critic's loss for one micro-batch, built from the config of their role."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from posttrain.algorithms.aggregation import LossNormalizer, aggregate_loss
from posttrain.algorithms.gkd import chunked_generalized_jsd
from posttrain.algorithms.kl import kl_penalty
from posttrain.algorithms.masked import masked_mean
from posttrain.algorithms.policy_loss import PolicyLossInputs, get_policy_loss
from posttrain.algorithms.rollout_correction import mismatch_metrics
from posttrain.algorithms.value_loss import compute_value_loss
from posttrain.config.schema import ActorConfig, CriticConfig, DistillConfig
from posttrain.data.batch import RolloutBatch
from posttrain.forward.lm_head import chunked_head_parameters
from posttrain.forward.passes import (
    DEFAULT_OPTIONS,
    ForwardOptions,
    critic_values,
    logprobs_from_response_hidden,
    policy_logprobs,
    response_hidden_states,
)
from posttrain.train.update import LossFn, LossShare


@dataclass(frozen=True)
class TeacherTerm:
    """The GKD term's teacher: the frozen module, how its pass runs, and the `distill` section (its weights)."""

    module: nn.Module
    options: ForwardOptions
    section: DistillConfig


def actor_loss_fn(
    model: nn.Module,
    cfg: ActorConfig,
    temperature: float,
    options: ForwardOptions = DEFAULT_OPTIONS,
    gkd: TeacherTerm | None = None,
) -> LossFn:
    """Policy loss − entropy bonus + KL loss (+ ``distill.gkd_coef`` x GKD's JSD to ``gkd``'s teacher) for one
    micro-batch (global normalizer).

    ``options`` says how the forward runs (packing, chunked head, activation offload); never what it computes.
    """
    policy_loss = get_policy_loss(cfg.policy_loss)

    def loss_fn(mb: RolloutBatch, normalizer: LossNormalizer):
        hidden = None
        if gkd is None:
            logprobs, entropy = policy_logprobs(
                model, mb, temperature=temperature, with_entropy=True, options=options
            )
        else:  # the GKD term reads the student's hidden states too: one forward for both
            hidden = response_hidden_states(model, mb, options)
            logprobs, entropy = logprobs_from_response_hidden(model, mb, hidden, temperature, True, options)
        mask = mb.response_mask
        old_log_probs = mb.old_log_probs
        if old_log_probs is None:  # the plan skipped the old-log-prob pass: this forward is the old policy's
            old_log_probs = logprobs.detach()
        loss, metrics = policy_loss(
            PolicyLossInputs(
                old_log_prob=old_log_probs,
                log_prob=logprobs,
                advantages=mb.advantages,
                response_mask=mask,
                clip_ratio_low=cfg.clip_ratio_low,
                clip_ratio_high=cfg.clip_ratio_high,
                clip_ratio_c=cfg.clip_ratio_c,
                normalizer=normalizer,
                loss_agg_mode=cfg.loss_agg_mode,
                rollout_is_weights=mb.rollout_is_weights,
            )
        )
        metrics = {f"actor/{k}": v for k, v in metrics.items()}
        if mb.old_log_probs is None and mb.rollout_log_probs is not None:
            metrics.update(_token_mismatch_metrics(old_log_probs, mb.rollout_log_probs, mask))
        metrics["actor/pg_loss"] = LossShare(loss.detach())  # a share of the mini-batch loss: summed
        if cfg.entropy_coeff != 0:
            loss = loss - cfg.entropy_coeff * aggregate_loss(entropy, mask, cfg.loss_agg_mode, normalizer)
        metrics["actor/entropy"] = masked_mean(entropy.detach(), mask)
        if cfg.use_kl_loss:
            kl = kl_penalty(logprobs, mb.ref_log_probs, cfg.kl_loss_type)
            kl_loss = aggregate_loss(kl, mask, cfg.loss_agg_mode, normalizer)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = masked_mean(kl.detach(), mask)
        if gkd is not None:
            jsd = gkd_per_token(model, hidden, mb, gkd)
            loss = loss + gkd.section.gkd_coef * aggregate_loss(jsd, mask, cfg.loss_agg_mode, normalizer)
            metrics["actor/gkd_loss"] = masked_mean(jsd.detach(), mask)
        return loss, metrics

    return loss_fn


def gkd_per_token(model: nn.Module, hidden: torch.Tensor, mb: RolloutBatch, gkd: TeacherTerm) -> torch.Tensor:
    """``[B, R]`` GKD's generalized JSD of each trained token between the student (``hidden``: its response
    hidden states) and the teacher, chunked over tokens from both LM heads (0 on untrained tokens)."""
    d = gkd.section
    with torch.no_grad():
        teacher_hidden = response_hidden_states(gkd.module, mb, gkd.options)
    weight, bias = chunked_head_parameters(model, "distill.gkd_coef")
    t_weight, t_bias = chunked_head_parameters(gkd.module, "distill.gkd_coef")
    b, r, h = hidden.shape
    jsd = chunked_generalized_jsd(
        hidden.reshape(b * r, h),
        weight,
        teacher_hidden.reshape(b * r, -1),
        t_weight,
        mb.response_mask.reshape(-1) > 0,
        beta=d.gkd_beta,
        temperature=d.gkd_temperature,
        top_k=d.gkd_top_k,
        chunk_size=d.gkd_chunk_size,
        student_bias=bias,
        teacher_bias=t_bias,
    )
    return jsd.view(b, r)


# The rollout-mismatch diagnostics that are token means: their token-weighted average over micro-batches (and
# ranks) is exactly the whole batch's, so the update can report them when it computes the old log-probs itself.
TOKEN_MEAN_MISMATCH_METRICS = ("log_prob_abs_diff_mean", "kl", "k3_kl", "chi2_token")


def _token_mismatch_metrics(old_log_probs, rollout_log_probs, mask) -> dict[str, float]:
    metrics = mismatch_metrics(old_log_probs, rollout_log_probs, mask)
    return {f"rollout_corr/{k}": metrics[f"rollout_corr/{k}"] for k in TOKEN_MEAN_MISMATCH_METRICS}


def critic_loss_fn(critic: nn.Module, cfg: CriticConfig, options: ForwardOptions = DEFAULT_OPTIONS) -> LossFn:
    """Clipped value loss for one micro-batch (global normalizer); ``options`` as for the actor."""

    def loss_fn(mb: RolloutBatch, normalizer: LossNormalizer):
        vpreds = critic_values(critic, mb, options)
        loss, metrics = compute_value_loss(
            vpreds=vpreds,
            returns=mb.returns,
            values=mb.values,
            response_mask=mb.response_mask,
            cliprange_value=cfg.cliprange_value,
            normalizer=normalizer,
            loss_agg_mode=cfg.loss_agg_mode,
        )
        out = {f"critic/{k}": v for k, v in metrics.items()}
        out["critic/vpred_mean"] = masked_mean(vpreds.detach(), mb.response_mask)
        return loss, out

    return loss_fn
