"""The actor's and the critic's loss for one micro-batch, built from the config of their role."""

from __future__ import annotations

from torch import nn

from posttrain.algorithms.aggregation import LossNormalizer, aggregate_loss
from posttrain.algorithms.kl import kl_penalty
from posttrain.algorithms.masked import masked_mean
from posttrain.algorithms.policy_loss import PolicyLossInputs, get_policy_loss
from posttrain.algorithms.rollout_correction import mismatch_metrics
from posttrain.algorithms.value_loss import compute_value_loss
from posttrain.config.schema import ActorConfig, CriticConfig
from posttrain.data.batch import RolloutBatch
from posttrain.forward.passes import DEFAULT_OPTIONS, ForwardOptions, critic_values, policy_logprobs
from posttrain.train.update import LossFn, LossShare


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
        return loss, metrics

    return loss_fn


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
