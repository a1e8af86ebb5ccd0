"""Rollout-correction weights in the policy losses, against verl's formula written out per token."""

import math

import pytest
import torch

from posttrain.algorithms.aggregation import LossNormalizer
from posttrain.algorithms.policy_loss import POLICY_LOSSES, PolicyLossInputs

LOW, HIGH, C = 0.2, 0.28, 3.0
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 1, 1]], dtype=torch.float64)
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(MASK.shape, generator=g, dtype=torch.float64) * 2
    new = old + torch.randn(MASK.shape, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(MASK.shape, generator=g, dtype=torch.float64)
    weights = torch.rand(MASK.shape, generator=g, dtype=torch.float64) * 2 * MASK
    return old, new.requires_grad_(True), adv, weights


def run(name, old, new, adv, mode="token-mean", **kw):
    norm = LossNormalizer.from_mask(MASK, norm_constant=MASK.shape[1])
    return POLICY_LOSSES[name](
        PolicyLossInputs(
            old_log_prob=old,
            log_prob=new,
            advantages=adv,
            response_mask=MASK,
            normalizer=norm,
            loss_agg_mode=mode,
            clip_ratio_low=LOW,
            clip_ratio_high=HIGH,
            clip_ratio_c=C,
            **kw,
        )
    )


def vanilla_token(old, new, a):
    """verl's vanilla per-token loss: clip-higher surrogate, dual-clip for negative advantages."""
    r = math.exp(max(min(new - old, 20.0), -20.0))
    surrogate = max(-a * r, -a * min(max(r, 1 - LOW), 1 + HIGH))
    return min(surrogate, -a * C) if a < 0 else surrogate


def gspo_token(seq_log_ratio, a):
    s = math.exp(min(seq_log_ratio, 10.0))
    return max(-a * s, -a * min(max(s, 1 - LOW), 1 + HIGH))


def aggregate(per_token, mode):
    """The loss modes over the whole (single micro-batch) mini-batch, from their definitions."""
    rows = [[v for v, m in zip(row, mrow) if m] for row, mrow in zip(per_token, MASK.tolist())]
    rows = [r for r in rows if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / len(rows) / MASK.shape[1]


def weighted_reference(name, old, new, adv, weights):
    """pg_losses * rollout_is_weights per token, computed without the implementation."""
    o, n, a, w = (t.detach().tolist() for t in (old, new, adv, weights))
    out = []
    for i in range(len(o)):
        valid = [j for j in range(len(o[i])) if MASK[i, j]]
        seq = sum(n[i][j] - o[i][j] for j in valid) / max(len(valid), 1)
        row = []
        for j in range(len(o[i])):
            if name == "vanilla":
                base = vanilla_token(o[i][j], n[i][j], a[i][j])
            elif name == "gspo":
                base = gspo_token(seq, a[i][j])
            else:  # gpg: -A * log_prob
                base = -a[i][j] * n[i][j]
            row.append(base * w[i][j])
        out.append(row)
    return out


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gpg"])
@pytest.mark.parametrize("mode", MODES)
def test_weighted_loss_matches_verl_formula(name, mode):
    old, new, adv, weights = inputs(1)
    loss, _ = run(name, old, new, adv, mode, rollout_is_weights=weights)
    assert loss.item() == pytest.approx(
        aggregate(weighted_reference(name, old, new, adv, weights), mode), rel=1e-7
    )  # eps in the mean denominators


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gpg"])
@pytest.mark.parametrize("mode", MODES)
def test_unit_weights_give_the_unweighted_loss_bit_for_bit(name, mode):
    old, new, adv, _ = inputs(2)
    plain, plain_metrics = run(name, old, new, adv, mode)
    (g_plain,) = torch.autograd.grad(plain, new)
    ones, ones_metrics = run(name, old, new, adv, mode, rollout_is_weights=torch.ones_like(old))
    (g_ones,) = torch.autograd.grad(ones, new)
    assert torch.equal(plain, ones) and torch.equal(g_plain, g_ones)
    assert all(torch.equal(plain_metrics[k], ones_metrics[k]) for k in plain_metrics)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gpg"])
def test_weights_scale_the_gradient_and_not_the_metrics(name):
    old, new, adv, weights = inputs(3)
    _, plain_metrics = run(name, old, new, adv)
    loss, metrics = run(name, old, new, adv, rollout_is_weights=weights.requires_grad_(True))
    (g_new, g_w) = torch.autograd.grad(loss, (new, weights), allow_unused=True)
    assert g_w is None  # the weights are treated as constants
    assert all(torch.equal(plain_metrics[k], metrics[k]) for k in metrics)
    if name == "vanilla":  # token-mean: d loss / d log_prob_t scales with w_t
        plain, _ = run(name, old, new, adv)
        (g_plain,) = torch.autograd.grad(plain, new)
        torch.testing.assert_close(g_new, g_plain * weights.detach(), rtol=1e-12, atol=1e-15)


def test_weights_of_the_wrong_shape_are_refused():
    old, new, adv, weights = inputs(4)
    with pytest.raises(ValueError, match="rollout_is_weights must be"):
        run("vanilla", old, new, adv, rollout_is_weights=weights[:, :2])
