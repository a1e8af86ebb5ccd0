"""KL estimators between the policy and the reference model, KL controllers, and KL-in-reward.

Estimators follow J. Schulman, "Approximating KL divergence" (2020) and verl's ``kl_penalty``; with
``d = log_prob - ref_log_prob``:

- ``"k1"`` / ``"kl"``: ``d``
- ``"abs"``: ``|d|``
- ``"k2"`` / ``"mse"``: ``0.5 * d^2``
- ``"k3"`` / ``"low_var_kl"``: ``exp(-d) + d - 1`` with ``d`` clamped to [-20, 20] and the result to [-10, 10]

A ``"+"`` suffix (``"k1+"``, ``"k3+"``, ``"low_var_kl+"``, ...) is a straight-through variant: the value is the
base estimator's, the gradient is k2's (``d``), whose expected gradient is the gradient of the true KL.

Two ways to use them: as a loss term (``use_kl_loss``: ``aggregate_loss(kl_penalty(...), mask, mode, normalizer)``)
or in the reward (:func:`apply_kl_penalty`, scaled by a controller's coefficient).
"""

from __future__ import annotations

import torch

from posttrain.algorithms.masked import masked_mean
from posttrain.algorithms.names import KL_ESTIMATORS, KL_KINDS  # noqa: F401 (KL_ESTIMATORS: re-exported)

K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def _base_kl(log_ratio: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "k1":
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind == "k2":
        return 0.5 * log_ratio.square()
    ref_minus_log = torch.clamp(-log_ratio, min=-K3_LOG_RATIO_CLAMP, max=K3_LOG_RATIO_CLAMP)
    k3 = torch.exp(ref_minus_log) - ref_minus_log - 1
    return torch.clamp(k3, min=-K3_VALUE_CLAMP, max=K3_VALUE_CLAMP)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate.

    Args:
        log_prob: ``[B, T]`` log-probs of the sampled tokens under the policy.
        ref_log_prob: ``[B, T]`` the same under the reference model.
        kl_penalty: one of :data:`KL_ESTIMATORS`.

    Returns:
        ``[B, T]`` estimate (not masked; aggregate it with the response mask).
    """
    return _estimate(log_prob, ref_log_prob, kl_penalty)


def _estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, name: str) -> torch.Tensor:
    straight_through = name.endswith("+")
    base = name[:-1] if straight_through else name
    if base not in KL_KINDS:
        raise ValueError(f"kl_penalty={name!r} is not supported; valid: {KL_ESTIMATORS}")
    kind = KL_KINDS[base]
    log_ratio = log_prob - ref_log_prob
    value = _base_kl(log_ratio, kind)
    if not straight_through or kind == "k2":
        return value
    k2 = 0.5 * log_ratio.square()
    return value.detach() + (k2 - k2.detach())


class FixedKLController:
    """Constant KL coefficient (verl's ``FixedKLController``)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept so both controllers share one interface)."""


class AdaptiveKLController:
    """Proportional controller steering the measured KL towards ``target_kl`` (Ziegler et al. 2019; verl).

    ``update`` multiplies the coefficient by ``1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps /
    horizon``; verl passes the batch size as ``n_steps``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if not target_kl > 0:
            raise ValueError(f"target_kl must be > 0 for the adaptive KL controller, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0 for the adaptive KL controller, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt the coefficient after a batch of ``n_steps`` samples whose mean KL was ``current_kl``."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KLController = FixedKLController | AdaptiveKLController
KL_CONTROLLER_KINDS: tuple[str, ...] = ("fixed", "adaptive")


def make_kl_controller(
    kind: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> KLController:
    """Build a controller: ``"fixed"`` uses ``kl_coef``; ``"adaptive"`` also needs ``target_kl`` and ``horizon``."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError(
                f"kl_ctrl kind 'adaptive' needs target_kl and horizon, got target_kl={target_kl}, horizon={horizon}"
            )
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"kl_ctrl kind={kind!r} is not supported; valid: {list(KL_CONTROLLER_KINDS)}")


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward (verl's ``apply_kl_penalty``): ``rewards = scores - beta * kl * mask``.

    Args:
        token_level_scores: ``[B, T]`` task rewards (usually the outcome score on the last valid token).
        old_log_prob, ref_log_prob: ``[B, T]`` rollout-policy and reference log-probs.
        response_mask: ``[B, T]`` bool or float.
        kl_ctrl: supplies ``beta = kl_ctrl.value``; it is NOT updated here.
        kl_penalty: estimator name, one of :data:`KL_ESTIMATORS`.

    Returns:
        ``(token_level_rewards [B, T], metrics)`` with ``"actor/reward_kl_penalty"`` (the KL averaged per
        sequence over its valid tokens, then over sequences; fully masked rows count as 0, as in verl) and
        ``"actor/reward_kl_penalty_coeff"`` (``beta``). Unlike verl, the caller updates the controller:
        ``kl_ctrl.update(metrics["actor/reward_kl_penalty"], n_steps=batch_size)``.
    """
    if token_level_scores.shape != response_mask.shape:
        raise ValueError(
            f"token_level_scores shape {tuple(token_level_scores.shape)} != response_mask shape "
            f"{tuple(response_mask.shape)}"
        )
    kld = _estimate(old_log_prob, ref_log_prob, kl_penalty).to(token_level_scores.dtype)
    kld = torch.where(response_mask.bool(), kld, torch.zeros_like(kld)) * response_mask.to(kld.dtype)
    beta = float(kl_ctrl.value)
    rewards = token_level_scores - beta * kld
    current_kl = float(masked_mean(kld, response_mask, dim=-1).mean().item())
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
