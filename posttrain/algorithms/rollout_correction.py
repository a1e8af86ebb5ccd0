"""Rollout–training mismatch correction as a run configures it (``algorithm.rollout_correction``).

:func:`compute_rollout_correction` runs the pieces of :mod:`posttrain.algorithms.rollout_mismatch` (IS weights,
rejection, the token veto, the diagnostics) from the section's keys; :func:`check_rollout_correction` checks those
keys together before training, and :func:`rollout_correction_kwargs` reads them after that check.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.algorithms.rollout_mismatch import (
    IS_LEVELS,
    PREFIX,
    RS_LEVELS,
    apply_keep,
    check_shapes,
    compute_rollout_is_weights,
    compute_rollout_rejection_mask,
    compute_token_veto_mask,
    mismatch_metrics,
    rollout_log_ratio,
)

_SECTION = "algorithm.rollout_correction"


def compute_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | None = None,
    rollout_rs_threshold_lower: float | None = None,
    rollout_token_veto_threshold: float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """IS weights, rejection mask and diagnostics in one call (verl's ``compute_rollout_correction_and_rejection_mask``).

    Steps: IS weights from the original mask (if ``rollout_is``); rejection by ``rollout_rs``; the token veto
    (if ``rollout_token_veto_threshold``) on top of it; then :func:`mismatch_metrics`. The keyword arguments are
    the ``algorithm.rollout_correction`` keys of the same names (``bypass_mode`` is not used here). The trainer
    passes the weights to the policy loss (``rollout_is_weights=``) and trains on the returned mask.

    Args:
        old_log_prob: ``[B, T]`` the trainer's log-probs of the sampled tokens.
        rollout_log_prob: ``[B, T]`` the rollout engine's log-probs of the same tokens.
        response_mask: ``[B, T]`` bool or float; at least one token.

    Returns:
        ``(weights, mask, metrics)``: ``weights`` ``[B, T]`` detached (None when ``rollout_is`` is None),
        ``mask`` ``[B, T]`` the response mask with rejected tokens zeroed (a new tensor, same dtype), ``metrics``
        ``{"rollout_corr/<name>": float}``; ``rollout_is_veto_fraction`` and
        ``rollout_is_catastrophic_token_fraction`` are 0 when the veto is off.
    """
    check_shapes(response_mask, old_log_prob, rollout_log_prob)
    if rollout_rs is not None and rollout_rs_threshold is None:
        raise ValueError(f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold; set it, e.g. 2.0")
    log_ratio = rollout_log_ratio(old_log_prob, rollout_log_prob)
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        weights, is_metrics = compute_rollout_is_weights(
            log_ratio, response_mask, rollout_is, rollout_is_threshold
        )
        metrics.update(is_metrics)
    mask = response_mask.clone()
    if rollout_rs is not None:
        mask, rs_metrics = compute_rollout_rejection_mask(
            log_ratio, response_mask, rollout_rs, rollout_rs_threshold, rollout_rs_threshold_lower
        )
        metrics.update(rs_metrics)
    if rollout_token_veto_threshold is not None:
        veto_mask, veto_metrics = compute_token_veto_mask(
            log_ratio, response_mask, rollout_token_veto_threshold
        )
        mask = apply_keep(mask, veto_mask.bool())
        metrics.update(veto_metrics)
    else:
        metrics[PREFIX + "rollout_is_veto_fraction"] = 0.0
        metrics[PREFIX + "rollout_is_catastrophic_token_fraction"] = 0.0
    metrics.update(mismatch_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, mask, metrics


def rollout_correction_kwargs(section: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`compute_rollout_correction` read from an ``algorithm.rollout_correction``
    section (any object with those attributes), after :func:`check_rollout_correction`."""
    check_rollout_correction(section)
    names = (
        "rollout_is",
        "rollout_is_threshold",
        "rollout_rs",
        "rollout_rs_threshold",
        "rollout_rs_threshold_lower",
        "rollout_token_veto_threshold",
    )
    return {name: getattr(section, name) for name in names}


def _fail(key: str, value: Any, rule: str, fix: str) -> None:
    raise ValueError(f"config key '{_SECTION}.{key}' = {value!r}: {rule}; {fix}")  # rl/checks.py: ConfigError


def check_rollout_correction(section: Any) -> None:
    """Check the ``algorithm.rollout_correction`` keys together; ValueError naming key, value, rule and fix.

    Rules: ``rollout_is`` in (None, token, sequence) and ``rollout_rs`` in (None, token, sequence, geometric);
    ``rollout_is_threshold >= 1``; with ``rollout_rs`` set, ``rollout_rs_threshold`` is required and ``>= 1``;
    ``0 <= rollout_rs_threshold_lower <= 1`` and not above the upper threshold; ``0 < rollout_token_veto_threshold
    < 1``. (The bounds keep an on-policy ratio of 1 untruncated and never rejected.)

    Args:
        section: an object with the section's attributes (the config dataclass or a namespace).
    """
    rollout_is = getattr(section, "rollout_is", None)
    rollout_rs = getattr(section, "rollout_rs", None)
    upper = getattr(section, "rollout_rs_threshold", None)
    veto = getattr(section, "rollout_token_veto_threshold", None)
    _check_levels(rollout_is, rollout_rs)
    if rollout_is is not None:
        _check_is_threshold(getattr(section, "rollout_is_threshold", 2.0))
    _check_rejection_bounds(rollout_rs, upper, getattr(section, "rollout_rs_threshold_lower", None))
    if veto is not None and not 0.0 < veto < 1.0:
        _fail(
            "rollout_token_veto_threshold",
            veto,
            "a veto ratio must be in (0, 1)",
            "use e.g. 1e-4, or null to disable the veto",
        )


def _check_levels(rollout_is: str | None, rollout_rs: str | None) -> None:
    if rollout_is is not None and rollout_is not in IS_LEVELS:
        _fail(
            "rollout_is", rollout_is, f"must be null or one of {', '.join(IS_LEVELS)}", "use rollout_is=token"
        )
    if rollout_rs is not None and rollout_rs not in RS_LEVELS:
        _fail(
            "rollout_rs", rollout_rs, f"must be null or one of {', '.join(RS_LEVELS)}", "use rollout_rs=token"
        )


def _check_is_threshold(is_threshold: float) -> None:
    if not is_threshold >= 1.0:
        _fail(
            "rollout_is_threshold",
            is_threshold,
            "an upper truncation bound must be >= 1 (ratio 1 is on-policy)",
            "use e.g. 2.0",
        )


def _check_rejection_bounds(rollout_rs: str | None, upper: float | None, lower: float | None) -> None:
    """The ``rollout_rs`` thresholds; ``upper`` is checked even when rejection is off (a set key must be valid)."""
    if rollout_rs is not None and upper is None:
        _fail(
            "rollout_rs_threshold",
            upper,
            f"rollout_rs={rollout_rs!r} needs an upper rejection bound",
            "set e.g. rollout_rs_threshold=2.0 (1.001 for geometric)",
        )
    if upper is not None and not upper >= 1.0:
        _fail(
            "rollout_rs_threshold",
            upper,
            "an upper rejection bound must be >= 1 (ratio 1 is on-policy)",
            "use e.g. 2.0, or its reciprocal if you meant a lower bound (rollout_rs_threshold_lower)",
        )
    if lower is not None and upper is not None and lower > upper:
        _fail(
            "rollout_rs_threshold_lower",
            lower,
            f"the lower bound exceeds rollout_rs_threshold={upper!r}",
            f"use a value <= 1, e.g. {1.0 / upper:g}",
        )
    if lower is not None and not 0.0 <= lower <= 1.0:
        _fail(
            "rollout_rs_threshold_lower",
            lower,
            "a lower rejection bound must be in [0, 1]",
            "use e.g. 0.5, or null for 1 / rollout_rs_threshold",
        )
