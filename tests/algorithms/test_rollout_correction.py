"""Rollout–training mismatch correction against hand-computed values.

Masked means divide by ``count + 1e-8`` (verl's), hence the 1e-8 tolerances. The fixture has two responses, the first with a padded last position whose log ratio is a huge outlier (-50)
that must never show up in any result. Valid token ratios π_old / π_rollout are 2, 1/2 (row 0) and 1, 3, 1/4
(row 1).
"""

import math
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms.rollout_correction import (
    check_rollout_correction,
    compute_rollout_correction,
    rollout_correction_kwargs,
)
from posttrain.algorithms.rollout_mismatch import (
    compute_rollout_is_weights,
    compute_rollout_rejection_mask,
    compute_token_veto_mask,
    mismatch_metrics,
    rollout_log_ratio,
)
from posttrain.config.schema import RolloutCorrectionConfig

L2, L3, L4 = math.log(2), math.log(3), math.log(4)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float64)
ROLLOUT = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.0, -2.0]], dtype=torch.float64)
RHO = torch.tensor([[L2, -L2, -50.0], [0.0, L3, -L4]], dtype=torch.float64)
OLD = ROLLOUT + RHO
P = "rollout_corr/"


def metric(metrics, name):
    return metrics[P + name]


def test_mismatch_metrics_by_hand():
    m = mismatch_metrics(OLD, ROLLOUT, MASK)
    approx = lambda x: pytest.approx(x, rel=1e-8, abs=1e-12)  # noqa: E731
    assert metric(m, "log_prob_abs_diff_mean") == approx((L2 + L2 + 0 + L3 + L4) / 5)
    assert metric(m, "log_prob_abs_diff_max") == approx(L4)
    # kl = mean(rollout - old) over the five tokens; k3 = mean(r - log r - 1)
    assert metric(m, "kl") == approx(-(L2 - L2 + 0 + L3 - L4) / 5)
    assert metric(m, "k3_kl") == approx(
        ((2 - L2 - 1) + (0.5 + L2 - 1) + 0 + (3 - L3 - 1) + (0.25 + L4 - 1)) / 5
    )
    # per-sequence summed log ratios: row 0 -> 0, row 1 -> log(3/4)
    assert metric(m, "seq_log_ratio_mean") == approx(math.log(0.75) / 2)
    assert metric(m, "seq_log_ratio_max") == approx(0.0)
    assert metric(m, "seq_log_ratio_min") == approx(math.log(0.75))
    train_means = [(-1 + L2 - 2 - L2) / 2, (-0.5 + 0 - 1 + L3 - 2 - L4) / 3]
    rollout_means = [-1.5, -3.5 / 3]
    assert metric(m, "training_ppl") == approx(sum(math.exp(-x) for x in train_means) / 2)
    assert metric(m, "training_log_ppl") == approx(-sum(train_means) / 2)
    assert metric(m, "rollout_ppl") == approx(sum(math.exp(-x) for x in rollout_means) / 2)
    assert metric(m, "rollout_log_ppl") == approx(-sum(rollout_means) / 2)
    d = [rollout_means[0] - train_means[0], rollout_means[1] - train_means[1]]  # [0, -log(3/4)/3]
    assert d[0] == approx(0.0) and d[1] == approx(-math.log(0.75) / 3)
    assert metric(m, "log_ppl_diff") == approx(sum(d) / 2)
    assert metric(m, "log_ppl_abs_diff") == approx((abs(d[0]) + abs(d[1])) / 2)
    assert metric(m, "log_ppl_diff_max") == approx(max(d))
    assert metric(m, "log_ppl_diff_min") == approx(min(d))
    assert metric(m, "ppl_ratio") == approx((math.exp(d[0]) + math.exp(d[1])) / 2)
    assert metric(m, "chi2_token") == approx((4 + 0.25 + 1 + 9 + 1 / 16) / 5 - 1)
    assert metric(m, "chi2_seq") == approx((1 + 0.75**2) / 2 - 1)
    assert all(isinstance(v, float) for v in m.values())


def test_token_is_weights_truncate_and_zero_padding():
    w, m = compute_rollout_is_weights(RHO, MASK, "token", 2.5)
    expected = torch.tensor([[2.0, 0.5, 0.0], [1.0, 2.5, 0.25]], dtype=torch.float64)
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=0)
    assert not w.requires_grad
    approx = lambda x: pytest.approx(x, rel=1e-8)  # noqa: E731
    # statistics of the untruncated weights 2, 0.5, 1, 3, 0.25; thresholds 2.5 and 1/2.5 = 0.4
    assert metric(m, "rollout_is_mean") == approx(6.75 / 5)
    assert metric(m, "rollout_is_max") == approx(3.0)
    assert metric(m, "rollout_is_min") == approx(0.25)
    assert metric(m, "rollout_is_ratio_fraction_high") == approx(0.2)  # the share truncated
    assert metric(m, "rollout_is_ratio_fraction_low") == approx(0.2)
    clamped = [2.0, 0.5, 1.0, 2.5, 0.4]
    mean = sum(clamped) / 5
    second = sum(x * x for x in clamped) / 5
    assert metric(m, "rollout_is_std") == approx(math.sqrt(second - mean**2))
    assert metric(m, "rollout_is_eff_sample_size") == pytest.approx(mean**2 / second, rel=1e-7)
    rows = [(2 + 0.5) / 2, (1 + 3 + 0.25) / 3]
    assert metric(m, "rollout_is_seq_mean") == approx(sum(rows) / 2)
    assert metric(m, "rollout_is_seq_std") == approx(abs(rows[0] - rows[1]) / math.sqrt(2))
    assert metric(m, "rollout_is_seq_max") == approx(rows[1])
    assert metric(m, "rollout_is_seq_min") == approx(rows[0])
    assert metric(m, "rollout_is_seq_max_deviation") == pytest.approx(rows[1] - 1, rel=1e-7)
    assert metric(m, "rollout_is_seq_fraction_high") == 0.0
    assert metric(m, "rollout_is_seq_fraction_low") == 0.0


def test_sequence_is_weights_are_the_product_per_row():
    w, m = compute_rollout_is_weights(RHO, MASK, "sequence", 2.5)
    expected = torch.tensor([[1.0, 1.0, 0.0], [0.75, 0.75, 0.75]], dtype=torch.float64)
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=1e-12)
    assert metric(m, "rollout_is_max") == pytest.approx(1.0)
    assert metric(m, "rollout_is_min") == pytest.approx(0.75)
    assert metric(m, "rollout_is_ratio_fraction_high") == 0.0
    assert metric(m, "rollout_is_mean") == pytest.approx((1 + 1 + 0.75 * 3) / 5)


def test_sequence_is_truncation_and_fractions_count_rows():
    rho = torch.tensor([[L3, 0.0], [math.log(0.1), 0.0]], dtype=torch.float64)
    mask = torch.ones_like(rho)
    w, m = compute_rollout_is_weights(rho, mask, "sequence", 2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0], [0.1, 0.1]], dtype=torch.float64))
    assert metric(m, "rollout_is_ratio_fraction_high") == 0.5
    assert metric(m, "rollout_is_ratio_fraction_low") == 0.5
    assert metric(m, "rollout_is_max") == pytest.approx(3.0)  # before truncation
    # a sequence log ratio past the safety bound still gives a finite weight
    w, m = compute_rollout_is_weights(torch.full((1, 3), 10.0), torch.ones(1, 3), "sequence", 5.0)
    assert torch.equal(w, torch.full((1, 3), 5.0))
    assert metric(m, "rollout_is_max") == pytest.approx(math.exp(20.0))


def test_token_rejection_removes_outlier_tokens():
    mask, m = compute_rollout_rejection_mask(RHO, MASK, "token", 2.5)  # keep ratios in [0.4, 2.5]
    assert torch.equal(mask, torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float64))
    assert metric(m, "rollout_rs_masked_fraction") == pytest.approx(2 / 5)
    assert metric(m, "rollout_rs_seq_masked_fraction") == 0.5
    assert metric(m, "rollout_rs_ratio_fraction_high") == pytest.approx(0.2)
    assert metric(m, "rollout_rs_ratio_fraction_low") == pytest.approx(0.2)
    mask, m = compute_rollout_rejection_mask(RHO, MASK, "token", 2.5, rollout_rs_threshold_lower=0.2)
    assert torch.equal(mask, torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.float64))
    assert metric(m, "rollout_rs_masked_fraction") == pytest.approx(1 / 5)


def test_sequence_and_geometric_rejection_remove_whole_rows():
    mask, m = compute_rollout_rejection_mask(RHO, MASK, "sequence", 1.2, rollout_rs_threshold_lower=0.8)
    assert torch.equal(mask, torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.float64))  # row 1: 3/4 < 0.8
    assert metric(m, "rollout_rs_masked_fraction") == pytest.approx(3 / 5)
    assert metric(m, "rollout_rs_seq_masked_fraction") == 0.5
    # geometric mean of row 1 is 0.75 ** (1/3) ~ 0.909; lower bound 1 / 1.05 ~ 0.952
    mask, _ = compute_rollout_rejection_mask(RHO, MASK, "geometric", 1.05)
    assert torch.equal(mask, torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.float64))
    mask, _ = compute_rollout_rejection_mask(RHO, MASK, "geometric", 1.2)
    assert torch.equal(mask, MASK)


def test_token_veto_rejects_rows_and_ignores_padding():
    mask, m = compute_token_veto_mask(RHO, MASK, 0.3)  # row 1 has a 1/4 token; row 0's -50 is padding
    assert torch.equal(mask, torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.float64))
    assert metric(m, "rollout_is_veto_fraction") == 0.5
    assert metric(m, "rollout_is_catastrophic_token_fraction") == pytest.approx(1 / 5)
    # the veto reads the unclamped log ratio: -30 is below log(1e-12) even though exp(-20) would not be
    rho = torch.tensor([[-30.0, 0.0]])
    mask, _ = compute_token_veto_mask(rho, torch.ones(1, 2), math.exp(-25))
    assert torch.equal(mask, torch.zeros(1, 2))


def test_equal_log_probs_give_unit_weights_and_reject_nothing():
    mask = MASK.bool()
    for level in ("token", "sequence"):
        w, m, metrics = compute_rollout_correction(
            ROLLOUT,
            ROLLOUT.clone(),
            mask,
            rollout_is=level,
            rollout_is_threshold=2.0,
            rollout_rs="token",
            rollout_rs_threshold=1.0,
            rollout_rs_threshold_lower=1.0,
            rollout_token_veto_threshold=0.999,
        )
        assert torch.equal(w, mask.to(w.dtype))  # exactly 1 on tokens, 0 on padding
        assert torch.equal(m, mask) and m.dtype == torch.bool
        for name in (
            "kl",
            "k3_kl",
            "log_prob_abs_diff_mean",
            "log_prob_abs_diff_max",
            "chi2_seq",
            "log_ppl_diff",
            "rollout_rs_masked_fraction",
            "rollout_is_veto_fraction",
        ):
            assert metric(metrics, name) == 0.0, name
        assert metric(metrics, "chi2_token") == pytest.approx(0.0, abs=1e-8)  # 5 / (5 + 1e-8) - 1
        assert metric(metrics, "rollout_is_eff_sample_size") == pytest.approx(1.0)
        assert metric(metrics, "ppl_ratio") == 1.0


def test_entry_point_combines_steps_without_touching_inputs():
    mask_in = MASK.clone()
    w, mask, m = compute_rollout_correction(OLD, ROLLOUT, mask_in)
    assert w is None and torch.equal(mask, MASK) and mask is not mask_in
    assert metric(m, "rollout_is_veto_fraction") == 0.0 and P + "rollout_is_mean" not in m
    assert P + "kl" in m
    w, mask, m = compute_rollout_correction(
        OLD,
        ROLLOUT,
        mask_in,
        rollout_is="token",
        rollout_is_threshold=2.5,
        rollout_rs="token",
        rollout_rs_threshold=2.5,
        rollout_rs_threshold_lower=0.2,
        rollout_token_veto_threshold=0.3,
    )
    # IS weights come from the original mask; rejection then the veto shrink the training mask
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 0.0], [1.0, 2.5, 0.25]], dtype=torch.float64))
    assert torch.equal(mask, torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.float64))
    assert torch.equal(mask_in, MASK)
    assert metric(m, "rollout_rs_masked_fraction") == pytest.approx(1 / 5)
    assert metric(m, "rollout_is_veto_fraction") == 0.5
    with pytest.raises(ValueError, match="needs rollout_rs_threshold"):
        compute_rollout_correction(OLD, ROLLOUT, MASK, rollout_rs="token")
    with pytest.raises(ValueError, match="selects no token"):
        compute_rollout_correction(OLD, ROLLOUT, torch.zeros_like(MASK))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        compute_rollout_correction(OLD, ROLLOUT[:, :2], MASK)


def test_log_ratio_is_detached():
    old = OLD.clone().requires_grad_(True)
    assert not rollout_log_ratio(old, ROLLOUT).requires_grad
    w, _, _ = compute_rollout_correction(old, ROLLOUT, MASK, rollout_is="token")
    assert not w.requires_grad


def cfg(**kw):
    base = dict(
        rollout_is=None,
        rollout_is_threshold=2.0,
        rollout_rs=None,
        rollout_rs_threshold=None,
        rollout_rs_threshold_lower=None,
        rollout_token_veto_threshold=None,
        bypass_mode=False,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_defaults_pass_and_turn_everything_off():
    section = RolloutCorrectionConfig()
    check_rollout_correction(section)
    kwargs = rollout_correction_kwargs(section)
    assert kwargs == dict(
        rollout_is=None,
        rollout_is_threshold=2.0,
        rollout_rs=None,
        rollout_rs_threshold=None,
        rollout_rs_threshold_lower=None,
        rollout_token_veto_threshold=None,
    )
    w, mask, _ = compute_rollout_correction(OLD, ROLLOUT, MASK, **kwargs)
    assert w is None and torch.equal(mask, MASK)


@pytest.mark.parametrize(
    "kw, key, words",
    [
        (dict(rollout_is="seq"), "rollout_is", "one of token, sequence"),
        (dict(rollout_rs="tokens"), "rollout_rs", "one of token, sequence, geometric"),
        (dict(rollout_is="token", rollout_is_threshold=0.5), "rollout_is_threshold", "must be >= 1"),
        (dict(rollout_rs="token"), "rollout_rs_threshold", "needs an upper rejection bound"),
        (dict(rollout_rs="token", rollout_rs_threshold=0.5), "rollout_rs_threshold", "must be >= 1"),
        (
            dict(rollout_rs="token", rollout_rs_threshold=1.5, rollout_rs_threshold_lower=1.8),
            "rollout_rs_threshold_lower",
            "exceeds rollout_rs_threshold",
        ),
        (
            dict(rollout_rs="token", rollout_rs_threshold=3.0, rollout_rs_threshold_lower=1.5),
            "rollout_rs_threshold_lower",
            r"in \[0, 1\]",
        ),
        (dict(rollout_token_veto_threshold=0.0), "rollout_token_veto_threshold", r"in \(0, 1\)"),
        (dict(rollout_token_veto_threshold=2.0), "rollout_token_veto_threshold", r"in \(0, 1\)"),
    ],
)
def test_check_names_key_value_rule_and_fix(kw, key, words):
    with pytest.raises(ValueError, match=rf"'algorithm\.rollout_correction\.{key}' = .*{words}.*; (use|set)"):
        check_rollout_correction(cfg(**kw))


def test_check_accepts_typical_settings():
    check_rollout_correction(
        cfg(
            rollout_is="sequence",
            rollout_is_threshold=5.0,
            rollout_rs="geometric",
            rollout_rs_threshold=1.001,
            rollout_token_veto_threshold=1e-4,
        )
    )
    check_rollout_correction(
        cfg(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.0)
    )
