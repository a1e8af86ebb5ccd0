"""Policy-gradient losses, one small function each of one :class:`PolicyLossInputs`.

Every loss is called as::

    loss, metrics = POLICY_LOSSES[name](
        PolicyLossInputs(
            old_log_prob=..., log_prob=..., advantages=..., response_mask=...,   # [B, T] each
            clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
            normalizer=LossNormalizer.from_mask(mini_batch_mask, max_response_length),
            loss_agg_mode="token-mean",
            rollout_is_weights=None,                                              # or [B, T], see below
        )
    )

``loss`` is this micro-batch's contribution to the mini-batch loss (see :mod:`posttrain.algorithms.aggregation`):
backpropagate it as is. ``metrics`` holds detached scalar tensors named as in verl (without the ``actor/``
prefix); like verl they are masked means over *this* micro-batch's tokens, so a trainer should average them
weighted by the micro-batch token count (``posttrain.train.update.accumulate_and_step`` does).

``rollout_is_weights`` (optional, ``[B, T]``, no gradient) are the rollout-correction importance weights of
:mod:`posttrain.algorithms.rollout_correction`: as in verl, each token's policy loss is multiplied by its weight
before aggregation; the metrics are not weighted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from posttrain.algorithms.aggregation import LossNormalizer, aggregate_loss
from posttrain.algorithms.masked import masked_mean, masked_sum
from posttrain.algorithms.names import POLICY_LOSS_NAMES, check_implemented

LOG_RATIO_CLAMP = 20.0
"""vanilla: |log_prob - old_log_prob| is clamped to this before ``exp`` (verl's value)."""

GSPO_LOG_RATIO_MAX = 10.0
"""gspo: upper clamp of the token-level log importance ratio before ``exp`` (verl's value)."""


@dataclass(frozen=True)
class PolicyLossInputs:
    """What every policy loss reads; each one ignores the fields it does not need.

    old_log_prob, log_prob, advantages: ``[B, T]``; only ``log_prob`` carries gradient. response_mask: ``[B, T]``
    bool or float. clip_ratio_low, clip_ratio_high: the lower and upper clip ranges. clip_ratio_c: the dual-clip
    bound for negative advantages. normalizer, loss_agg_mode: see
    :func:`posttrain.algorithms.aggregation.aggregate_loss`. rollout_is_weights: optional ``[B, T]``
    rollout-correction weights (no gradient).
    """

    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    normalizer: LossNormalizer
    loss_agg_mode: str
    rollout_is_weights: torch.Tensor | None = None


PolicyLossFn = Callable[[PolicyLossInputs], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _check_inputs(inputs: PolicyLossInputs) -> None:
    tensors = (inputs.old_log_prob, inputs.log_prob, inputs.advantages, inputs.response_mask)
    shape = inputs.log_prob.shape
    if inputs.log_prob.dim() != 2 or any(t.shape != shape for t in tensors):
        raise ValueError(
            "old_log_prob, log_prob, advantages and response_mask must all be [B, T]; got shapes "
            f"{[tuple(t.shape) for t in tensors]}"
        )
    low, high = inputs.clip_ratio_low, inputs.clip_ratio_high
    if low < 0 or high < 0:
        raise ValueError(f"clip_ratio_low and clip_ratio_high must be >= 0, got {low} and {high}")


def _apply_rollout_is_weights(
    pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None
) -> torch.Tensor:
    """``pg_losses * rollout_is_weights`` (both ``[B, T]``), or ``pg_losses`` unchanged when there are none."""
    if rollout_is_weights is None:
        return pg_losses
    if rollout_is_weights.shape != pg_losses.shape:
        raise ValueError(
            f"rollout_is_weights must be [B, T] like the log-probs, got {tuple(rollout_is_weights.shape)} for "
            f"log-probs of shape {tuple(pg_losses.shape)}"
        )
    return pg_losses * rollout_is_weights.detach()


def compute_policy_loss_vanilla(inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clipping and dual-clip, as verl's ``vanilla`` policy loss.

    Per token, with ``r = exp(clamp(log_prob - old_log_prob, -20, 20))`` and advantage ``A``::

        clipped = max(-A * r, -A * clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high))   # "clip-higher"
        loss    = min(clipped, -A * clip_ratio_c)  if A < 0  else  clipped               # dual-clip

    Args:
        old_log_prob, log_prob, advantages: ``[B, T]``; only ``log_prob`` carries gradient.
        response_mask: ``[B, T]`` bool or float.
        clip_ratio_low, clip_ratio_high: lower/upper clip ranges (DAPO's clip-higher uses high > low).
        clip_ratio_c: dual-clip bound for negative advantages; must be > 1.
        normalizer, loss_agg_mode: see :func:`posttrain.algorithms.aggregation.aggregate_loss`.
        rollout_is_weights: optional ``[B, T]`` rollout-correction weights; ``loss`` per token is multiplied by
            them before aggregation (verl's order: after clipping and dual-clip).

    Returns:
        ``(loss, metrics)``: metrics ``pg_clipfrac`` (share of tokens where the clipped term is active),
        ``pg_clipfrac_lower`` (share where the dual-clip bound is active) and ``ppo_kl`` (mean of
        ``old_log_prob - log_prob``, clamped as above).
    """
    log_prob, advantages, response_mask, clip_ratio_c = (
        inputs.log_prob,
        inputs.advantages,
        inputs.response_mask,
        inputs.clip_ratio_c,
    )
    _check_inputs(inputs)
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1.0, got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - inputs.old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - inputs.clip_ratio_low, 1.0 + inputs.clip_ratio_high)
    pessimistic = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(pessimistic, dual_bound), pessimistic)

    pg_losses = _apply_rollout_is_weights(pg_losses, inputs.rollout_is_weights)
    loss = aggregate_loss(pg_losses, response_mask, inputs.loss_agg_mode, inputs.normalizer)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((clipped > unclipped).to(log_prob.dtype), response_mask),
            "pg_clipfrac_lower": masked_mean(
                ((pessimistic > dual_bound) & negative).to(log_prob.dtype), response_mask
            ),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


def compute_policy_loss_gspo(inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (sequence-level importance ratio), as verl's ``gspo`` policy loss.

    The sequence ratio is the geometric mean of token ratios over the valid tokens,
    ``s_i = exp(mean_t(log_prob - old_log_prob))``. Each token uses ``sg[s_i] * p_t / sg[p_t]`` (same value
    ``s_i``; the gradient flows through its own log-prob), clamped at ``exp(10)``, in the usual
    ``max(-A * s, -A * clamp(s, 1 - low, 1 + high))``. There is no dual-clip (``clip_ratio_c`` is
    ignored).

    Difference from verl: verl always aggregates GSPO with ``seq-mean-token-mean`` and ignores the configured
    mode; here ``loss_agg_mode`` is honoured, so set ``seq-mean-token-mean`` in the config for the paper's loss.

    ``rollout_is_weights`` (optional ``[B, T]``) multiply the clipped per-token losses before aggregation, as in
    verl's GSPO.

    Returns:
        ``(loss, metrics)`` with ``pg_clipfrac``, ``pg_clipfrac_lower`` (always 0) and ``ppo_kl``.
    """
    log_prob, advantages, response_mask = inputs.log_prob, inputs.advantages, inputs.response_mask
    _check_inputs(inputs)
    log_ratio = log_prob - inputs.old_log_prob
    seq_lengths = response_mask.to(log_prob.dtype).sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / seq_lengths  # [B]
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - inputs.clip_ratio_low, 1.0 + inputs.clip_ratio_high)
    pg_losses = torch.maximum(unclipped, clipped)

    pg_losses = _apply_rollout_is_weights(pg_losses, inputs.rollout_is_weights)
    loss = aggregate_loss(pg_losses, response_mask, inputs.loss_agg_mode, inputs.normalizer)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((clipped > unclipped).to(log_prob.dtype), response_mask),
            "pg_clipfrac_lower": torch.zeros((), dtype=log_prob.dtype, device=log_prob.device),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


def compute_policy_loss_gpg(inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG's plain policy gradient, as verl's ``gpg`` policy loss: ``-A * log_prob`` per token, no ratio.

    There is no importance ratio and no clipping (``clip_ratio_*`` are checked and
    ignored; ``old_log_prob`` only feeds the ``ppo_kl`` metric). On-policy (the first mini-batch of a step) its
    gradient equals the unclipped PPO gradient; later mini-batches of the same step are not corrected for the
    policy having moved, so GPG is usually run with one mini-batch per step. ``rollout_is_weights`` (optional
    ``[B, T]``) multiply the per-token losses before aggregation, as in verl.

    Returns:
        ``(loss, metrics)``; metrics hold ``ppo_kl`` (mean of ``old_log_prob - log_prob``), a diagnostic verl's
        ``gpg`` does not report (it reports none).
    """
    log_prob, response_mask = inputs.log_prob, inputs.response_mask
    _check_inputs(inputs)
    pg_losses = _apply_rollout_is_weights(-inputs.advantages * log_prob, inputs.rollout_is_weights)
    loss = aggregate_loss(pg_losses, response_mask, inputs.loss_agg_mode, inputs.normalizer)
    with torch.no_grad():
        ppo_kl = masked_mean(inputs.old_log_prob - log_prob, response_mask)
    return loss, {"ppo_kl": ppo_kl.detach()}


POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "vanilla": compute_policy_loss_vanilla,
    "gspo": compute_policy_loss_gspo,
    "gpg": compute_policy_loss_gpg,
}
check_implemented("policy loss", POLICY_LOSS_NAMES, POLICY_LOSSES)


def get_policy_loss(name: str) -> PolicyLossFn:
    """Look up a policy loss; ValueError naming ``name`` and the valid keys if unknown."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"policy_loss={name!r} is not supported; valid: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]
