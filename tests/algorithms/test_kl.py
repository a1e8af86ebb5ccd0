"""KL estimators, straight-through variants, controllers and KL-in-reward."""

import math

import numpy as np
import pytest
import torch

from posttrain.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
)


def ref_estimate(lp: float, ref: float, kind: str) -> float:
    d = lp - ref
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("k2", "mse"):
        return 0.5 * d * d
    x = min(max(ref - lp, -20.0), 20.0)  # k3 / low_var_kl
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


def pair(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(3, 4, generator=g, dtype=torch.float64) * 3
    ref = lp + torch.randn(3, 4, generator=g, dtype=torch.float64) * scale
    return lp, ref


@pytest.mark.parametrize("name", KL_ESTIMATORS)
def test_values_match_reference(name):
    lp, ref = pair(scale=4.0)  # large gaps exercise the k3 clamps
    got = kl_penalty(lp, ref, name)
    base = name.rstrip("+")
    expected = np.vectorize(lambda a, b: ref_estimate(a, b, base))(lp.numpy(), ref.numpy())
    np.testing.assert_allclose(got.detach().numpy(), expected, rtol=1e-12, atol=1e-12)


def test_k3_is_clamped_to_ten():
    lp = torch.tensor([[0.0]], dtype=torch.float64)
    assert kl_penalty(lp, torch.tensor([[15.0]], dtype=torch.float64), "k3").item() == 10.0
    assert kl_penalty(lp, torch.tensor([[-15.0]], dtype=torch.float64), "low_var_kl").item() == 10.0  # not 14
    inside = kl_penalty(lp, torch.tensor([[-5.0]], dtype=torch.float64), "k3").item()
    assert inside == pytest.approx(math.exp(-5.0) + 4.0)


@pytest.mark.parametrize("base", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_straight_through_value_is_base_gradient_is_k2(base):
    lp, ref = pair(1)
    lp.requires_grad_(True)
    ref.requires_grad_(True)
    value = kl_penalty(lp, ref, base + "+")
    torch.testing.assert_close(value, kl_penalty(lp, ref, base), rtol=0, atol=0)
    weights = torch.linspace(0.5, 2.0, lp.numel(), dtype=torch.float64).reshape(lp.shape)
    (value * weights).sum().backward()
    d = (lp - ref).detach()
    torch.testing.assert_close(lp.grad, d * weights)  # d/d lp of 0.5 * d^2
    torch.testing.assert_close(ref.grad, -d * weights)


def test_plain_estimators_keep_their_own_gradient():
    lp, ref = pair(2)
    lp.requires_grad_(True)
    kl_penalty(lp, ref, "k1").sum().backward()
    torch.testing.assert_close(lp.grad, torch.ones_like(lp))


def test_unknown_estimator():
    lp, ref = pair()
    with pytest.raises(ValueError, match=r"'full'.*low_var_kl"):
        kl_penalty(lp, ref, "full")
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(lp, ref, "k4+")


def test_fixed_controller():
    ctrl = make_kl_controller("fixed", kl_coef=0.05)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(current_kl=10.0, n_steps=64)
    assert ctrl.value == 0.05


def test_adaptive_controller_hand_computed():
    ctrl = make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.02, horizon=1000)
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(current_kl=0.022, n_steps=100)  # error 0.1 -> x (1 + 0.1 * 100 / 1000)
    assert ctrl.value == pytest.approx(0.1 * 1.01)
    ctrl.update(current_kl=1.0, n_steps=500)  # error clipped to 0.2 -> x 1.1
    assert ctrl.value == pytest.approx(0.1 * 1.01 * 1.1)
    ctrl.update(current_kl=0.0, n_steps=500)  # error clipped to -0.2 -> x 0.9
    assert ctrl.value == pytest.approx(0.1 * 1.01 * 1.1 * 0.9)


def test_controller_factory_errors():
    with pytest.raises(ValueError, match=r"'pid'.*adaptive"):
        make_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", kl_coef=0.1, horizon=100)
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.1, horizon=0)


def test_apply_kl_penalty_matches_reference_and_leaves_controller_alone():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    old, ref = pair(3)
    old[0, 3] = float("inf")  # garbage outside the mask must not leak into the rewards
    scores = torch.zeros(3, 4, dtype=torch.float64)
    scores[0, 2], scores[1, 0] = 1.0, -1.0
    ctrl = FixedKLController(0.5)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, kl_penalty="low_var_kl")
    per_seq = []
    for i in range(3):
        kls = [ref_estimate(old[i, t].item(), ref[i, t].item(), "k3") for t in range(4) if mask[i, t]]
        per_seq.append(sum(kls) / len(kls) if kls else 0.0)  # fully masked row counts as 0 (verl)
        for t in range(4):
            k = ref_estimate(old[i, t].item(), ref[i, t].item(), "k3") if mask[i, t] else 0.0
            assert rewards[i, t].item() == pytest.approx(scores[i, t].item() - 0.5 * k)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(sum(per_seq) / 3)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    assert ctrl.value == 0.5
