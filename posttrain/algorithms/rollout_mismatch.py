"""Rollout–training mismatch maths: log ratios, diagnostics, truncated importance weights, rejection masks.

The rollout engine samples with its own kernels (and possibly stale weights), so its log-probs ``rollout_log_prob``
differ from the trainer's recomputed old log-probs ``old_log_prob``. With the per-token log ratio
``ρ_t = old_log_prob - rollout_log_prob`` (``log π_old / π_rollout``) this module offers, as verl's rollout
correction does (``algorithm.rollout_correction``):

* diagnostics of the gap (:func:`mismatch_metrics`);
* truncated importance-sampling (IS) weights at token or sequence level (:func:`compute_rollout_is_weights`),
  which a policy loss multiplies into its per-token losses (``rollout_is_weights=``);
* rejection of outlier tokens or sequences by removing them from the response mask
  (:func:`compute_rollout_rejection_mask`, :func:`compute_token_veto_mask`).

:mod:`posttrain.algorithms.rollout_correction` runs them from the config keys and checks the keys. Every function
is pure: ``[B, T]`` tensors in, tensors and a dict of floats out. Metric names carry the ``rollout_corr/`` prefix
and match verl's. Weights, masks and metrics never carry gradient.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from posttrain.algorithms.masked import masked_mean, masked_sum

SAFETY_BOUND = 20.0
"""Log ratios are clamped to ``[-20, 20]`` before ``exp`` (verl's value; ``exp(20)`` is about 4.9e8)."""

IS_LEVELS = ("token", "sequence")
"""Values of ``rollout_is`` other than ``None``."""

RS_LEVELS = ("token", "sequence", "geometric")
"""Values of ``rollout_rs`` other than ``None``."""

PREFIX = "rollout_corr/"


def check_shapes(mask: torch.Tensor, *tensors: torch.Tensor) -> None:
    """ValueError unless ``mask`` and ``tensors`` are ``[B, T]`` of one shape and ``mask`` selects a token."""
    if mask.dim() != 2 or any(t.shape != mask.shape for t in tensors):
        raise ValueError(
            "log-prob tensors and response_mask must all be [B, T] of one shape; got "
            f"{[tuple(t.shape) for t in (*tensors, mask)]}"
        )
    if not bool(mask.bool().any()):
        raise ValueError(
            "response_mask selects no token: rollout correction needs at least one response token"
        )


def _item(x: torch.Tensor | float) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def apply_keep(response_mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``response_mask`` with the positions where ``keep`` is False zeroed, in the mask's own dtype."""
    if response_mask.dtype == torch.bool:
        return response_mask & keep
    return response_mask * keep.to(response_mask.dtype)


def rollout_log_ratio(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor) -> torch.Tensor:
    """Per-token ``log(π_old / π_rollout) = old_log_prob - rollout_log_prob``, detached.

    Args:
        old_log_prob: ``[B, T]`` the trainer's log-probs of the sampled tokens.
        rollout_log_prob: ``[B, T]`` the rollout engine's log-probs of the same tokens.

    Returns:
        ``[B, T]`` log ratio (padding positions hold whatever the inputs hold; callers mask).
    """
    return (old_log_prob - rollout_log_prob).detach()


def sequence_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence sum of the token log ratios over the mask: ``log Π_t π_old / π_rollout``.

    Args:
        log_ratio: ``[B, T]`` token log ratios.
        response_mask: ``[B, T]`` bool or float.

    Returns:
        ``[B]``; 0 for a row without response tokens.
    """
    return masked_sum(log_ratio, response_mask, dim=-1)


def mismatch_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Diagnostics of the gap between the rollout engine's and the trainer's log-probs.

    With ``ρ_t = old_log_prob - rollout_log_prob`` over the mask (token means are masked means over all tokens;
    sequence statistics are over the ``B`` rows, as in verl):

    * ``log_prob_abs_diff_mean`` / ``_max``: mean and max of ``|ρ_t|``;
    * ``kl``: ``mean(-ρ_t)``, the direct estimate of KL(π_rollout ‖ π_old) on rollout samples;
    * ``k3_kl``: ``mean(exp(ρ_t) - ρ_t - 1)``, the non-negative k3 estimate of the same KL;
    * ``seq_log_ratio_mean`` / ``_max`` / ``_min``: statistics of ``Σ_t ρ_t`` per sequence;
    * ``training_ppl`` / ``rollout_ppl``: batch mean of per-sequence perplexity ``exp(-mean_t log p)``, and
      ``training_log_ppl`` / ``rollout_log_ppl`` the mean of ``-mean_t log p``;
    * ``log_ppl_diff`` (mean), ``log_ppl_abs_diff``, ``log_ppl_diff_max`` / ``_min`` of
      ``d_i = mean_t rollout_log_prob - mean_t old_log_prob`` (``log`` of the per-sequence perplexity ratio);
    * ``ppl_ratio``: ``mean_i exp(d_i)``, training over rollout perplexity;
    * ``chi2_token``: ``mean(exp(2 ρ_t)) - 1`` and ``chi2_seq``: ``mean_i exp(2 Σ_t ρ_t) - 1`` (exponents
      clamped to ±20 before doubling).

    Args:
        old_log_prob, rollout_log_prob: ``[B, T]``.
        response_mask: ``[B, T]`` bool or float.

    Returns:
        ``{"rollout_corr/<name>": float}``.
    """
    check_shapes(response_mask, old_log_prob, rollout_log_prob)
    old, rollout = old_log_prob.detach(), rollout_log_prob.detach()
    log_ratio = old - rollout
    mask = response_mask.bool()
    abs_diff = log_ratio.abs()
    seq = sequence_log_ratio(log_ratio, response_mask)
    train_seq_mean = masked_mean(old, response_mask, dim=-1)
    rollout_seq_mean = masked_mean(rollout, response_mask, dim=-1)
    log_ppl_diff = rollout_seq_mean - train_seq_mean
    rho_token = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    rho_seq = torch.exp(2.0 * torch.clamp(seq, -SAFETY_BOUND, SAFETY_BOUND))
    metrics = {
        "log_prob_abs_diff_mean": masked_mean(abs_diff, response_mask),
        "log_prob_abs_diff_max": abs_diff.masked_fill(~mask, float("-inf")).max(),
        "kl": masked_mean(rollout - old, response_mask),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1.0, response_mask),
        "seq_log_ratio_mean": seq.mean(),
        "seq_log_ratio_max": seq.max(),
        "seq_log_ratio_min": seq.min(),
        "training_ppl": torch.exp(-train_seq_mean).mean(),
        "training_log_ppl": (-train_seq_mean).mean(),
        "rollout_ppl": torch.exp(-rollout_seq_mean).mean(),
        "rollout_log_ppl": (-rollout_seq_mean).mean(),
        "log_ppl_diff": log_ppl_diff.mean(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "log_ppl_diff_max": log_ppl_diff.max(),
        "log_ppl_diff_min": log_ppl_diff.min(),
        "ppl_ratio": torch.exp(log_ppl_diff).mean(),
        "chi2_token": masked_mean(rho_token.square(), response_mask) - 1.0,
        "chi2_seq": rho_seq.mean() - 1.0,
    }
    return {PREFIX + k: _item(v) for k, v in metrics.items()}


def ratio_weights(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Untruncated ratios ``π_old / π_rollout`` at one aggregation level, with the safety clamp.

    * ``token``: ``w_t = exp(clamp(ρ_t, -20, 20))``;
    * ``sequence``: ``w_t = exp(clamp(Σ_s ρ_s, -20, 20))`` for every token of the sequence;
    * ``geometric``: ``w_t = exp(clamp(mean_s ρ_s, -20, 20))`` (length-normalised; rejection only).

    Args:
        log_ratio: ``[B, T]`` token log ratios.
        response_mask: ``[B, T]`` bool or float.
        level: one of ``token``, ``sequence``, ``geometric``.

    Returns:
        ``(weights [B, T], level_log_ratio)``: ``level_log_ratio`` is the unclamped log ratio the weights come
        from, ``[B, T]`` for ``token`` and ``[B, 1]`` otherwise (used for exact threshold statistics).
    """
    if level == "token":
        level_log_ratio = log_ratio
    elif level == "sequence":
        level_log_ratio = sequence_log_ratio(log_ratio, response_mask).unsqueeze(-1)
    elif level == "geometric":
        level_log_ratio = masked_mean(log_ratio, response_mask, dim=-1).unsqueeze(-1)
    else:
        raise ValueError(f"ratio level {level!r} is not supported; valid: {list(RS_LEVELS)}")
    weights = torch.exp(torch.clamp(level_log_ratio, -SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    return weights, level_log_ratio


def weight_statistics(
    name: str,
    weights: torch.Tensor,
    level_log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    upper: float,
    lower: float,
) -> dict[str, float]:
    """verl's statistics of a set of ratio weights (before truncation), keyed ``rollout_corr/<name>_*``.

    * ``_mean``: masked mean of the weights; ``_max`` / ``_min``: over valid tokens at token level, over the
      rows' (unclamped) sequence ratios otherwise (max capped at ``exp(20)``);
    * ``_ratio_fraction_high`` / ``_low``: share of tokens (token level) or rows above ``upper`` / below
      ``lower``;
    * ``_std``: masked std of the weights clamped to ``[lower, upper]``;
    * ``_eff_sample_size``: ``1 / mean((w / mean w)^2)`` of the same clamped weights, in ``(0, 1]``;
    * ``_seq_mean`` / ``_seq_std`` / ``_seq_max`` / ``_seq_min`` / ``_seq_max_deviation`` (``max |w̄_i - 1|``) /
      ``_seq_fraction_high`` / ``_seq_fraction_low`` of the per-row mean weight ``w̄_i``.

    Args:
        name: ``rollout_is`` or ``rollout_rs``.
        weights: ``[B, T]`` untruncated weights (from :func:`ratio_weights`).
        level_log_ratio: ``[B, T]`` (token level) or ``[B, 1]`` log ratio behind the weights.
        response_mask: ``[B, T]`` bool or float.
        upper, lower: the thresholds the fractions refer to (``lower`` > 0).
    """
    mask = response_mask.bool()
    stats: dict[str, Any] = {"mean": masked_mean(weights, response_mask)}
    if level_log_ratio.shape == weights.shape:  # token level
        stats["max"] = weights.masked_fill(~mask, float("-inf")).max()
        stats["min"] = weights.masked_fill(~mask, float("inf")).min()
        stats["ratio_fraction_high"] = masked_mean((weights > upper).to(weights.dtype), response_mask)
        stats["ratio_fraction_low"] = masked_mean((weights < lower).to(weights.dtype), response_mask)
    else:
        stats["max"] = torch.exp(torch.clamp(level_log_ratio.max(), max=SAFETY_BOUND))
        stats["min"] = torch.exp(level_log_ratio.min())
        stats["ratio_fraction_high"] = (level_log_ratio > math.log(upper)).to(weights.dtype).mean()
        stats["ratio_fraction_low"] = (level_log_ratio < math.log(lower)).to(weights.dtype).mean()
    clamped = weights.clamp(min=lower, max=upper)
    clamped_mean = masked_mean(clamped, response_mask)
    if response_mask.to(weights.dtype).sum() > 1:
        var = masked_mean(clamped.square(), response_mask) - clamped_mean.square()
        stats["std"] = torch.sqrt(torch.clamp(var, min=0.0))
    else:
        stats["std"] = 0.0
    normalised = clamped / (clamped_mean + 1e-8)
    stats["eff_sample_size"] = 1.0 / _item(masked_mean(normalised.square(), response_mask))
    seq_mean = masked_mean(weights, response_mask, dim=-1)
    stats["seq_mean"] = seq_mean.mean()
    stats["seq_std"] = seq_mean.std() if seq_mean.numel() > 1 else 0.0
    stats["seq_max"] = seq_mean.max()
    stats["seq_min"] = seq_mean.min()
    stats["seq_max_deviation"] = (seq_mean - 1.0).abs().max()
    stats["seq_fraction_high"] = (seq_mean > upper).to(weights.dtype).mean()
    stats["seq_fraction_low"] = (seq_mean < lower).to(weights.dtype).mean()
    return {f"{PREFIX}{name}_{k}": _item(v) for k, v in stats.items()}


def truncate_is_weights(weights: torch.Tensor, response_mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """Truncated IS weights: ``min(w, threshold)`` on response tokens, 0 on padding, detached.

    Args:
        weights: ``[B, T]`` untruncated weights.
        response_mask: ``[B, T]`` bool or float.
        threshold: upper truncation bound (> 0).

    Returns:
        ``[B, T]`` weights without gradient.
    """
    return (weights * response_mask.to(weights.dtype)).clamp(max=threshold).detach()


def compute_rollout_is_weights(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_is: str, rollout_is_threshold: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights ``π_old / π_rollout`` at ``token`` or ``sequence`` level (verl's TIS).

    ``token``: ``w_t = min(exp(ρ_t), C)``. ``sequence``: ``w_t = min(exp(Σ_s ρ_s), C)`` for every token of the
    sequence. Exponents are clamped to ±20 first; padding gets 0; ``C = rollout_is_threshold``. Metrics
    (:func:`weight_statistics` under ``rollout_is_*``, fractions relative to ``C`` and ``1/C``) describe the
    weights before truncation, so ``rollout_is_ratio_fraction_high`` is the share truncated.

    Args:
        log_ratio: ``[B, T]`` token log ratios ``old_log_prob - rollout_log_prob``.
        response_mask: ``[B, T]`` bool or float.
        rollout_is: ``token`` or ``sequence``.
        rollout_is_threshold: ``C`` (> 0).

    Returns:
        ``(weights [B, T], metrics)``.
    """
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"rollout_is={rollout_is!r} is not supported; valid: None, {', '.join(IS_LEVELS)}")
    if not rollout_is_threshold > 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {rollout_is_threshold}")
    check_shapes(response_mask, log_ratio)
    weights, level_log_ratio = ratio_weights(log_ratio.detach(), response_mask, rollout_is)
    weights = weights * response_mask.to(weights.dtype)
    metrics = weight_statistics(
        "rollout_is",
        weights,
        level_log_ratio,
        response_mask,
        upper=rollout_is_threshold,
        lower=1.0 / rollout_is_threshold,
    )
    return truncate_is_weights(weights, response_mask, rollout_is_threshold), metrics


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str,
    rollout_rs_threshold: float,
    rollout_rs_threshold_lower: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Remove tokens or whole sequences whose ratio lies outside ``[lower, upper]`` from the mask.

    The ratio is :func:`ratio_weights` at level ``rollout_rs``: per token (``token``: only the outlier tokens
    go), or one per sequence (``sequence``: product of token ratios; ``geometric``: their geometric mean; the
    whole sequence goes). Kept where ``lower <= w <= upper``, with ``upper = rollout_rs_threshold`` and
    ``lower = rollout_rs_threshold_lower`` or ``1 / upper`` when that is None.

    Args:
        log_ratio: ``[B, T]`` token log ratios.
        response_mask: ``[B, T]`` bool or float.
        rollout_rs: ``token``, ``sequence`` or ``geometric``.
        rollout_rs_threshold: upper bound on the ratio.
        rollout_rs_threshold_lower: lower bound; None means ``1 / rollout_rs_threshold``.

    Returns:
        ``(mask [B, T], metrics)``: the response mask with rejected positions zeroed (same dtype), and
        :func:`weight_statistics` under ``rollout_rs_*`` plus ``rollout_rs_masked_fraction`` (share of response
        tokens removed) and ``rollout_rs_seq_masked_fraction`` (share of rows with a removed token at token
        level; share of rows rejected otherwise).
    """
    if rollout_rs not in RS_LEVELS:
        raise ValueError(f"rollout_rs={rollout_rs!r} is not supported; valid: None, {', '.join(RS_LEVELS)}")
    upper = float(rollout_rs_threshold)
    lower = float(rollout_rs_threshold_lower) if rollout_rs_threshold_lower is not None else 1.0 / upper
    check_shapes(response_mask, log_ratio)
    weights, level_log_ratio = ratio_weights(log_ratio.detach(), response_mask, rollout_rs)
    keep = (weights >= lower) & (weights <= upper)
    metrics = weight_statistics(
        "rollout_rs", weights, level_log_ratio, response_mask, upper=upper, lower=lower
    )
    rejected = (~keep).to(weights.dtype)
    metrics[PREFIX + "rollout_rs_masked_fraction"] = _item(masked_mean(rejected, response_mask))
    if rollout_rs == "token":
        seq_rejected = masked_sum(rejected, response_mask, dim=-1) > 0
    else:
        seq_rejected = ~keep[:, 0]
    metrics[PREFIX + "rollout_rs_seq_masked_fraction"] = _item(seq_rejected.to(weights.dtype).mean())
    return apply_keep(response_mask, keep), metrics


def compute_token_veto_mask(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_token_veto_threshold: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Reject every sequence that holds a response token with ``π_old / π_rollout < threshold``.

    The test uses the unclamped log ratio (``ρ_t < log threshold``), so it sees catastrophic tokens that the
    ±20 safety clamp would hide.

    Args:
        log_ratio: ``[B, T]`` token log ratios.
        response_mask: ``[B, T]`` bool or float.
        rollout_token_veto_threshold: the veto ratio (> 0).

    Returns:
        ``(mask [B, T], metrics)``: the mask with vetoed rows zeroed, ``rollout_is_veto_fraction`` (share of rows
        vetoed) and ``rollout_is_catastrophic_token_fraction`` (share of response tokens below the threshold).
    """
    if not rollout_token_veto_threshold > 0:
        raise ValueError(f"rollout_token_veto_threshold must be > 0, got {rollout_token_veto_threshold}")
    check_shapes(response_mask, log_ratio)
    catastrophic = (log_ratio.detach() < math.log(rollout_token_veto_threshold)) & response_mask.bool()
    vetoed = catastrophic.any(dim=-1, keepdim=True)
    metrics = {
        PREFIX + "rollout_is_veto_fraction": _item(vetoed.to(log_ratio.dtype).mean()),
        PREFIX + "rollout_is_catastrophic_token_fraction": _item(
            masked_mean(catastrophic.to(log_ratio.dtype), response_mask)
        ),
    }
    return apply_keep(response_mask, (~vetoed).expand_as(response_mask)), metrics
