"""Clipped value (critic) loss, as verl's ``compute_value_loss``."""

from __future__ import annotations

import torch

from posttrain.algorithms.aggregation import LossNormalizer, aggregate_loss
from posttrain.algorithms.masked import masked_mean


def compute_value_loss(
    *,
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    normalizer: LossNormalizer,
    loss_agg_mode: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO value loss ``0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2))``.

    Args:
        vpreds: ``[B, T]`` current critic predictions (carry gradient).
        returns: ``[B, T]`` targets from the advantage estimator.
        values: ``[B, T]`` critic predictions at rollout time (the clip centre).
        response_mask: ``[B, T]`` bool or float.
        cliprange_value: half-width ``c`` of the clip interval; must be >= 0.
        normalizer, loss_agg_mode: see :func:`posttrain.algorithms.aggregation.aggregate_loss`; like the policy
            loss, the result is this micro-batch's contribution to the mini-batch loss.

    Returns:
        ``(loss, metrics)`` with ``vf_clipfrac``: share of this micro-batch's valid tokens where the clipped
        error is the larger one (a detached scalar tensor).
    """
    shapes = [tuple(t.shape) for t in (vpreds, returns, values, response_mask)]
    if vpreds.dim() != 2 or len(set(shapes)) != 1:
        raise ValueError(f"vpreds, returns, values and response_mask must all be [B, T]; got shapes {shapes}")
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    vpred_clipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpred_clipped - returns) ** 2
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped, clipped), response_mask, loss_agg_mode, normalizer)
    with torch.no_grad():
        vf_clipfrac = masked_mean((clipped > unclipped).to(vpreds.dtype), response_mask)
    return loss, {"vf_clipfrac": vf_clipfrac.detach()}
