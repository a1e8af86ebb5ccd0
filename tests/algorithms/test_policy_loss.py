"""PPO (vanilla, clip-higher, dual-clip), GSPO and GPG policy losses against per-token Python references."""

import math

import numpy as np
import pytest
import torch

from posttrain.algorithms.aggregation import LOSS_AGG_MODES, LossNormalizer, aggregate_loss
from posttrain.algorithms.policy_loss import POLICY_LOSSES, PolicyLossInputs, get_policy_loss

LOW, HIGH, C = 0.2, 0.28, 3.0
MASK = torch.tensor(
    [[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 1, 1]], dtype=torch.float64
)


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(MASK.shape, generator=g, dtype=torch.float64) * 2
    new = old + torch.randn(MASK.shape, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(MASK.shape, generator=g, dtype=torch.float64)
    return old, new.requires_grad_(True), adv


def run(name, old, new, adv, mask=MASK, mode="token-mean", **kw):
    args = dict(clip_ratio_low=LOW, clip_ratio_high=HIGH, clip_ratio_c=C)
    args.update(kw)
    norm = LossNormalizer.from_mask(mask, norm_constant=mask.shape[1])
    return POLICY_LOSSES[name](
        PolicyLossInputs(
            old_log_prob=old,
            log_prob=new,
            advantages=adv,
            response_mask=mask,
            normalizer=norm,
            loss_agg_mode=mode,
            **args,
        )
    )


def vanilla_token(old, new, a, low=LOW, high=HIGH, c=C):
    """(loss, clipped?, dual-clipped?) for one token, from the PPO / dual-clip papers."""
    r = math.exp(max(min(new - old, 20.0), -20.0))
    surrogate = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
    clipped = -a * min(max(r, 1 - low), 1 + high) > -a * r
    if a < 0:
        return min(surrogate, -a * c), clipped, surrogate > -a * c
    return surrogate, clipped, False


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_vanilla_matches_reference(mode):
    old, new, adv = inputs()
    loss, metrics = run("vanilla", old, new, adv, mode=mode)
    mat = np.zeros(MASK.shape)
    clip, lower, kl, n = 0.0, 0.0, 0.0, MASK.sum().item()
    for i in range(MASK.shape[0]):
        for t in range(MASK.shape[1]):
            mat[i, t], c1, c2 = vanilla_token(old[i, t].item(), new[i, t].item(), adv[i, t].item())
            if MASK[i, t]:
                clip, lower, kl = clip + c1, lower + c2, kl + old[i, t].item() - new[i, t].item()
    norm = LossNormalizer.from_mask(MASK, MASK.shape[1])
    expected = aggregate_loss(torch.tensor(mat), MASK, mode, norm)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10)
    assert metrics["pg_clipfrac"].item() == pytest.approx(clip / n)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(lower / n)
    assert metrics["ppo_kl"].item() == pytest.approx(kl / n)
    assert all(not v.requires_grad for v in metrics.values())


def one_token(new, a, name="vanilla", **kw):
    old = torch.zeros(1, 1, dtype=torch.float64)
    lp = torch.tensor([[math.log(new)]], dtype=torch.float64, requires_grad=True)
    loss, metrics = run(name, old, lp, torch.tensor([[a]], dtype=torch.float64), mask=torch.ones(1, 1), **kw)
    loss.backward()
    return loss.item(), lp.grad.item(), metrics


def test_vanilla_hand_computed_cases():
    # A > 0, ratio 1.5 above 1 + high: clipped at 1.28, no gradient
    loss, grad, m = one_token(1.5, 2.0)
    assert (
        loss == pytest.approx(-2.0 * 1.28) and grad == 0.0 and m["pg_clipfrac"].item() == pytest.approx(1.0)
    )
    # clip-higher: ratio 1.25 is inside (1 - 0.2, 1 + 0.28): unclipped, d(-A r)/d log r = -A r
    loss, grad, m = one_token(1.25, 2.0)
    assert loss == pytest.approx(-2.5) and grad == pytest.approx(-2.5) and m["pg_clipfrac"].item() == 0.0
    # A < 0, ratio 0.5 below 1 - low: max(-A r, -A clip) = -A * 0.8 = 0.8
    loss, grad, m = one_token(0.5, -1.0)
    assert loss == pytest.approx(0.8) and grad == 0.0 and m["pg_clipfrac"].item() == pytest.approx(1.0)
    # A < 0, ratio 5: -A r = 5 exceeds the dual-clip bound -A c = 3 -> loss 3, no gradient
    loss, grad, m = one_token(5.0, -1.0)
    assert loss == pytest.approx(3.0) and grad == 0.0 and m["pg_clipfrac_lower"].item() == pytest.approx(1.0)
    # A < 0, ratio 2 below c: plain -A r with gradient -A r = 2
    loss, grad, m = one_token(2.0, -1.0)
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0) and m["pg_clipfrac_lower"].item() == 0.0


def test_vanilla_rejects_bad_dual_clip():
    old, new, adv = inputs()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        run("vanilla", old, new, adv, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        run("vanilla", old, new, adv, clip_ratio_low=-0.1)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gspo_matches_reference_value_and_gradient(mode):
    old, new, adv = inputs(1)
    loss, metrics = run("gspo", old, new, adv, mode=mode)
    loss.backward()
    mat, dmat = np.zeros(MASK.shape), np.zeros(MASK.shape)
    clip, n = 0.0, MASK.sum().item()
    for i in range(MASK.shape[0]):
        valid = [t for t in range(MASK.shape[1]) if MASK[i, t]]
        mean_log_ratio = sum(new[i, t].item() - old[i, t].item() for t in valid) / max(len(valid), 1)
        s = math.exp(min(mean_log_ratio, 10.0))
        for t in range(MASK.shape[1]):
            a = adv[i, t].item()
            clipped_s = min(max(s, 1 - LOW), 1 + HIGH)
            mat[i, t] = max(-a * s, -a * clipped_s)
            is_clipped = -a * clipped_s > -a * s
            dmat[i, t] = 0.0 if is_clipped else -a * s  # straight-through: d s_token / d log_prob_t = s
            clip += is_clipped and bool(MASK[i, t])
    norm = LossNormalizer.from_mask(MASK, MASK.shape[1])
    assert loss.item() == pytest.approx(aggregate_loss(torch.tensor(mat), MASK, mode, norm).item(), rel=1e-10)
    # gradient: the aggregation is linear, so push the per-token derivative through it
    weights = torch.zeros(MASK.shape, dtype=torch.float64, requires_grad=True)
    aggregate_loss(weights, MASK, mode, norm).backward()
    np.testing.assert_allclose(new.grad.numpy(), dmat * weights.grad.numpy(), atol=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(clip / n)
    assert metrics["pg_clipfrac_lower"].item() == 0.0


def test_gspo_ratio_is_per_sequence():
    """Tokens of one sequence share the same ratio: moving one token's log-prob moves all of them."""
    loss, grad, _ = one_token(1.1, 1.0, name="gspo")
    assert loss == pytest.approx(-1.1) and grad == pytest.approx(-1.1)
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[math.log(1.21), 0.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = run("gspo", old, new, torch.ones(1, 2, dtype=torch.float64), mask=torch.ones(1, 2))
    assert loss.item() == pytest.approx(-1.1)  # geometric mean of 1.21 and 1.0, token-mean of two equal terms


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gpg_matches_reference_value_and_gradient(mode):
    old, new, adv = inputs(3)
    loss, metrics = run("gpg", old, new, adv, mode=mode)
    loss.backward()
    # GPG: the per-token loss is -A * log_prob (no ratio, no clipping), so d/d log_prob = -A
    mat = [[-adv[i, t].item() * new[i, t].item() for t in range(MASK.shape[1])] for i in range(MASK.shape[0])]
    norm = LossNormalizer.from_mask(MASK, MASK.shape[1])
    assert loss.item() == pytest.approx(
        aggregate_loss(torch.tensor(mat, dtype=torch.float64), MASK, mode, norm).item(), rel=1e-10
    )
    weights = torch.zeros(MASK.shape, dtype=torch.float64, requires_grad=True)
    aggregate_loss(weights, MASK, mode, norm).backward()
    np.testing.assert_allclose(new.grad.numpy(), -adv.numpy() * weights.grad.numpy(), atol=1e-12)
    kl = sum(old[i, t].item() - new[i, t].item() for i in range(5) for t in range(4) if MASK[i, t])
    assert set(metrics) == {"ppo_kl"} and metrics["ppo_kl"].item() == pytest.approx(kl / MASK.sum().item())


def test_gpg_hand_computed_cases_ignore_the_ratio():
    # p = 0.5, A = 2: loss -2 * log 0.5 = 2 log 2; gradient -A = -2 (old log-prob 0: the ratio 0.5 is not used)
    loss, grad, _ = one_token(0.5, 2.0, name="gpg")
    assert loss == pytest.approx(2 * math.log(2)) and grad == pytest.approx(-2.0)
    # p = 5 (ratio 5, far past any clip or dual-clip bound), A = -1: loss log 5, gradient +1, never clipped
    loss, grad, _ = one_token(5.0, -1.0, name="gpg")
    assert loss == pytest.approx(math.log(5)) and grad == pytest.approx(1.0)


def test_registry():
    assert set(POLICY_LOSSES) == {"vanilla", "gspo", "gpg"}
    with pytest.raises(ValueError, match=r"'ppo'.*gpg.*gspo.*vanilla"):
        get_policy_loss("ppo")


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_fully_masked_row_has_no_gradient_and_no_nan(name):
    old, new, adv = inputs(2)
    with torch.no_grad():
        new[3] = float("nan")  # garbage in a fully masked row must not leak
    loss, metrics = run(name, old, new, adv, mode="seq-mean-token-mean")
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.all(new.grad[3] == 0)
    assert all(torch.isfinite(v) for v in metrics.values())
