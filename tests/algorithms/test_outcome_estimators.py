"""OPO, GPG and GRPO pass@k advantages against numbers worked out by hand from the published formulas."""

import math

import pytest
import torch

from posttrain.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, estimator_needs

NEW = ("opo", "gpg", "grpo_passk")


def outcome(scores, lengths, width=None, left_pad=()):
    """Rewards and mask for outcome scores: each row has ``lengths[i]`` valid tokens, the score on the last."""
    width = width or max(lengths)
    rewards = torch.zeros(len(scores), width, dtype=torch.float64)
    mask = torch.zeros(len(scores), width, dtype=torch.bool)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        cols = range(width - n, width) if i in left_pad else range(n)
        mask[i, list(cols)] = True
        if n:
            rewards[i, max(cols)] = s
    return rewards, mask


def run(name, rewards, mask, group_ids, **kw):
    adv, ret = ADVANTAGE_ESTIMATORS[name](
        AdvantageInputs(token_level_rewards=rewards, response_mask=mask, group_ids=group_ids, **kw)
    )
    assert torch.equal(adv, ret)
    return adv


def per_row(adv, mask):
    """The scalar of each row, after checking it is the same on every valid token and 0 on padding."""
    out = []
    for row, m in zip(adv, mask):
        assert torch.all(row[~m] == 0)
        valid = row[m]
        assert torch.all(valid == valid[0]) if valid.numel() else True
        out.append(valid[0].item() if valid.numel() else 0.0)
    return out


# ---- OPO: r_i - sum_g(l * r) / sum_g(l), no std ----


def test_opo_hand_computed():
    # group a: scores 1, 0, 1 with lengths 2, 4, 2 -> baseline (2*1 + 4*0 + 2*1) / 8 = 0.5 (the plain mean is 2/3)
    # group b: one sample, score 3 -> baseline 0, advantage 3
    # group c: scores 2, 5 with lengths 3, 1 -> baseline (3*2 + 1*5) / 4 = 2.75 -> -0.75, 2.25
    rewards, mask = outcome([1, 0, 1, 3, 2, 5], [2, 4, 2, 1, 3, 1], left_pad={2, 5})
    adv = run("opo", rewards, mask, ["a", "a", "a", "b", "c", "c"])
    assert per_row(adv, mask) == pytest.approx([0.5, -0.5, 0.5, 3.0, -0.75, 2.25], abs=1e-12)


def test_opo_ignores_the_std_flag_and_equal_lengths_give_the_group_mean():
    # equal lengths: the length-weighted baseline is the plain mean 1/3 -> 2/3, -1/3, -1/3 (no std division)
    rewards, mask = outcome([1, 0, 0], [3, 3, 3])
    for flag in (True, False):
        adv = run("opo", rewards, mask, [0, 0, 0], norm_adv_by_std_in_grpo=flag)
        assert per_row(adv, mask) == pytest.approx([2 / 3, -1 / 3, -1 / 3], abs=1e-12)


def test_opo_fully_masked_group_gives_zero_not_nan():
    rewards, mask = outcome([1, 2, 1], [0, 0, 2])
    adv = run("opo", rewards, mask, [0, 0, 1])
    assert torch.isfinite(adv).all()
    assert per_row(adv, mask) == [0.0, 0.0, 1.0]  # the singleton group keeps its score


# ---- GPG: alpha * (r_i - mean_g), alpha = B / #(non-zero scores) over the whole batch ----


def test_gpg_hand_computed():
    # B = 6 samples, scores 1, 0, 1 | 0, 0 | 2: three are non-zero -> alpha = 6 / 3 = 2
    # group a: mean 2/3 -> 2 * (1/3) = 2/3, 2 * (-2/3) = -4/3, 2/3; group b: all 0; group c (singleton, mean 0): 4
    rewards, mask = outcome([1, 0, 1, 0, 0, 2], [2, 3, 1, 3, 2, 2])
    adv = run("gpg", rewards, mask, [0, 0, 0, 1, 1, 2])
    assert per_row(adv, mask) == pytest.approx([2 / 3, -4 / 3, 2 / 3, 0, 0, 4], abs=1e-12)


def test_gpg_no_std_and_alpha_one_when_every_score_is_non_zero():
    # all four scores non-zero -> alpha = 4 / 4 = 1; group means 2 and 0.5; no std division either way
    rewards, mask = outcome([3, 1, 0.25, 0.75], [2, 2, 2, 2])
    for flag in (True, False):
        adv = run("gpg", rewards, mask, [0, 0, 1, 1], norm_adv_by_std_in_grpo=flag)
        assert per_row(adv, mask) == pytest.approx([1, -1, -0.25, 0.25], abs=1e-12)


def test_gpg_all_zero_scores_give_zero():
    rewards, mask = outcome([0, 0, 0, 0], [1, 2, 3, 4])
    adv = run("gpg", rewards, mask, [0, 0, 1, 1])
    assert torch.all(adv == 0)


# ---- GRPO pass@k: only the best of a group, (r_max - r_second) / (std_g + eps) ----


def test_grpo_passk_hand_computed():
    # group a: 1, 0, 3, 2 -> the 3 gets 3 - 2 = 1; unbiased std: mean 1.5, squares .25+2.25+2.25+.25 = 5,
    #   5 / 3 -> sqrt(5/3); advantage 1 / (sqrt(5/3) + 1e-6)
    # group b: 2, 2, 0 -> the top score is shared: margin 0, the whole group 0
    # group c: 0, 5 -> 5 - 0 = 5; std sqrt(12.5); advantage 5 / (sqrt(12.5) + 1e-6) = sqrt(2) (to ~1e-6)
    scores = [1, 0, 3, 2, 2, 2, 0, 0, 5]
    rewards, mask = outcome(scores, [1, 2, 3, 4, 4, 3, 2, 1, 2], left_pad={2})
    groups = ["a"] * 4 + ["b"] * 3 + ["c"] * 2
    adv = run("grpo_passk", rewards, mask, groups)
    expected = [0, 0, 1 / (math.sqrt(5 / 3) + 1e-6), 0, 0, 0, 0, 0, 5 / (math.sqrt(12.5) + 1e-6)]
    assert per_row(adv, mask) == pytest.approx(expected, abs=1e-12)
    raw = run("grpo_passk", rewards, mask, groups, norm_adv_by_std_in_grpo=False)
    assert per_row(raw, mask) == pytest.approx([0, 0, 1, 0, 0, 0, 0, 0, 5], abs=1e-12)


def test_grpo_passk_interleaved_groups():
    # groups x = rows 0, 2, 4 (scores 0, 4, 1) and y = rows 1, 3 (scores 2, 1); unnormalised margins 3 and 1
    rewards, mask = outcome([0, 2, 4, 1, 1], [2, 2, 2, 2, 2])
    adv = run("grpo_passk", rewards, mask, torch.tensor([9, 4, 9, 4, 9]), norm_adv_by_std_in_grpo=False)
    assert per_row(adv, mask) == pytest.approx([0, 1, 3, 0, 0], abs=1e-12)


def test_grpo_passk_rejects_a_group_of_one():
    rewards, mask = outcome([1, 0, 1], [1, 1, 1])
    with pytest.raises(ValueError, match="at least 2 samples"):
        run("grpo_passk", rewards, mask, [0, 0, 1])


# ---- all three ----


@pytest.mark.parametrize("name", NEW)
def test_identical_scores_in_every_group_give_zero(name):
    rewards, mask = outcome([0.7] * 4 + [0.0] * 3, [1, 2, 3, 4, 2, 2, 2])
    adv = run(name, rewards, mask, [0, 0, 0, 0, 1, 1, 1])
    assert torch.isfinite(adv).all() and torch.all(adv == 0)


@pytest.mark.parametrize("name", NEW)
def test_broadcast_over_valid_tokens_and_zero_on_padding(name):
    # right-padded, left-padded, a gap in the middle (an observation span), full
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0, 1], [1, 1, 1, 1]], dtype=torch.bool)
    rewards = torch.zeros(4, 4, dtype=torch.float64)
    rewards[[0, 1, 2, 3], [1, 3, 3, 3]] = torch.tensor([1.0, 0.0, 2.0, 0.5], dtype=torch.float64)
    adv = run(name, rewards, mask, [0, 0, 1, 1])
    scalars = per_row(adv, mask)
    assert any(s != 0 for s in scalars)


@pytest.mark.parametrize("name", NEW)
def test_need_groups_and_group_ids(name):
    needs = estimator_needs(name)
    assert needs.groups and not needs.critic and not needs.greedy_baseline
    rewards, mask = outcome([1, 0], [1, 1])
    with pytest.raises(ValueError, match="group_ids"):
        run(name, rewards, mask, None)
