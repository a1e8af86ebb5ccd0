"""Advantage estimators against plain-Python / numpy references written from the papers and verl's semantics."""

import numpy as np
import pytest
import torch

from posttrain.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATORS_NEEDING_CRITIC,
    AdvantageInputs,
    get_advantage_estimator,
    needs_critic,
)

# right-padded, full, single valid token, left-padded, gap in the middle (observation span), fully masked
MASK = np.array(
    [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0],
        [0, 0, 1, 1, 1],
        [1, 1, 0, 0, 1],
        [0, 0, 0, 0, 0],
    ],
    dtype=np.float64,
)
B, T = MASK.shape


def dense_rewards(seed=0):
    return np.random.default_rng(seed).normal(size=(B, T))


def outcome_rewards(scores):
    """Outcome score on the last valid token of each row (zeros for a fully masked row)."""
    r = np.zeros((B, T))
    for i, s in enumerate(scores):
        valid = np.nonzero(MASK[i])[0]
        if len(valid):
            r[i, valid[-1]] = s
    return r


def call(name, rewards, mask=MASK, **kw):
    kw.setdefault("group_ids", list(range(len(rewards))))
    fn = ADVANTAGE_ESTIMATORS[name]
    adv, ret = fn(
        AdvantageInputs(token_level_rewards=torch.tensor(rewards), response_mask=torch.tensor(mask), **kw)
    )
    return adv.numpy(), ret.numpy()


def whiten_ref(x, mask):
    sel = x[mask.astype(bool)]
    return (x - sel.mean()) / np.sqrt(np.var(sel, ddof=1) + 1e-8)


def test_gae_matches_reference_loop():
    rewards, values = dense_rewards(1), dense_rewards(2)
    gamma, lam = 0.9, 0.8
    raw = np.zeros((B, T))
    for i in range(B):
        next_v, gae = 0.0, 0.0
        for t in reversed(range(T)):
            if MASK[i, t]:  # masked tokens are skipped entirely
                delta = rewards[i, t] + gamma * next_v - values[i, t]
                gae = delta + gamma * lam * gae
                next_v = values[i, t]
                raw[i, t] = gae
    adv, ret = call("gae", rewards, values=torch.tensor(values), gamma=gamma, lam=lam)
    np.testing.assert_allclose(ret, (raw + values) * MASK, atol=1e-12)
    np.testing.assert_allclose(adv, whiten_ref(raw, MASK) * MASK, atol=1e-6)


def test_gae_requires_values():
    with pytest.raises(ValueError, match="values"):
        call("gae", dense_rewards())


def grpo_ref(scores, groups, norm_by_std, eps=1e-6):
    out = []
    for i, s in enumerate(scores):
        members = np.array([scores[j] for j in range(len(scores)) if groups[j] == groups[i]])
        if len(members) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = members.mean(), members.std(ddof=1)
        out.append((s - mean) / (std + eps) if norm_by_std else s - mean)
    return np.array(out)


GROUPS = ["a", "b", "a", "b", "a", "c"]  # interleaved, group "c" has one member
SCORES = np.array([1.0, 0.0, 0.0, 0.5, 1.0, 0.7])


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_reference(norm_by_std):
    adv, ret = call("grpo", outcome_rewards(SCORES), group_ids=GROUPS, norm_adv_by_std_in_grpo=norm_by_std)
    expected = grpo_ref([outcome_rewards(SCORES)[i].sum() for i in range(B)], GROUPS, norm_by_std)
    np.testing.assert_allclose(adv, expected[:, None] * MASK, atol=1e-12)
    np.testing.assert_array_equal(adv, ret)


def test_grpo_hand_computed_values():
    mask = np.ones((4, 1))
    adv, _ = call("grpo", np.array([[1.0], [0.0], [1.0], [3.0]]), mask=mask, group_ids=[0, 0, 1, 2])
    # group 0: mean 0.5, unbiased std sqrt(0.5); groups 1 and 2 are singletons: mean 0, std 1
    s = np.sqrt(0.5)
    np.testing.assert_allclose(
        adv[:, 0], [0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 1 / (1 + 1e-6), 3 / (1 + 1e-6)]
    )


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"])
def test_identical_rewards_in_group_give_zero_advantage(name):
    mask = np.ones((4, 3))
    rewards = np.zeros((4, 3))
    rewards[:, -1] = 0.7
    adv, _ = call(name, rewards, mask=mask, group_ids=[5, 5, 5, 5])
    assert np.all(np.isfinite(adv))
    np.testing.assert_allclose(adv, 0.0, atol=1e-9)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg"])
def test_interleaved_groups_equal_contiguous_permuted(name):
    perm = [0, 2, 4, 1, 3, 5]  # contiguous order: a a a b b c
    rewards = dense_rewards(3)
    ids = torch.tensor([7, 3, 7, 3, 7, 11])
    adv, _ = call(name, rewards, group_ids=ids)
    adv_c, _ = call(name, rewards[perm], mask=MASK[perm], group_ids=ids[perm])
    np.testing.assert_allclose(adv[perm], adv_c, atol=1e-12)


def test_drgrpo_is_grpo_without_std_even_if_flag_says_otherwise():
    r = outcome_rewards(SCORES)
    dr, _ = call("drgrpo", r, group_ids=GROUPS, norm_adv_by_std_in_grpo=True)
    plain, _ = call("grpo", r, group_ids=GROUPS, norm_adv_by_std_in_grpo=False)
    np.testing.assert_array_equal(dr, plain)


def test_rloo_matches_leave_one_out_reference():
    rewards = outcome_rewards(SCORES)
    scores = rewards.sum(-1)
    adv, _ = call("rloo", rewards, group_ids=GROUPS)
    for i in range(B):
        others = [scores[j] for j in range(B) if GROUPS[j] == GROUPS[i] and j != i]
        expected = scores[i] - np.mean(others) if others else scores[i]  # singleton keeps its score
        np.testing.assert_allclose(adv[i], expected * MASK[i], atol=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_reference(gamma):
    rewards = dense_rewards(4)
    returns = np.zeros((B, T))
    for i in range(B):
        running = 0.0
        for t in reversed(range(T)):
            if MASK[i, t]:  # masked spans are skipped, the return is carried across them
                running = rewards[i, t] + gamma * running
                returns[i, t] = running
    adv, ret = call("reinforce_plus_plus", rewards, gamma=gamma)
    np.testing.assert_allclose(ret, returns, atol=1e-12)
    np.testing.assert_allclose(adv, whiten_ref(returns, MASK) * MASK, atol=1e-6)


def test_reinforce_plus_plus_baseline_matches_reference():
    rewards = outcome_rewards(SCORES)
    scores = rewards.sum(-1)
    centred = np.zeros((B, T))
    for i in range(B):
        members = [scores[j] for j in range(B) if GROUPS[j] == GROUPS[i]]
        mean = np.mean(members) if len(members) > 1 else 0.0
        centred[i] = (scores[i] - mean) * MASK[i]
    adv, ret = call("reinforce_plus_plus_baseline", rewards, group_ids=GROUPS)
    np.testing.assert_allclose(adv, whiten_ref(centred, MASK) * MASK, atol=1e-6)
    np.testing.assert_array_equal(adv, ret)


def test_remax_matches_reference():
    rewards, baselines = dense_rewards(6), np.linspace(-1, 1, B)
    adv, ret = call("remax", rewards, reward_baselines=torch.tensor(baselines))
    for i in range(B):
        for t in range(T):
            if MASK[i, t]:
                to_go = sum(rewards[i, s] for s in range(t, T) if MASK[i, s])
                assert ret[i, t] == pytest.approx(to_go)
                assert adv[i, t] == pytest.approx(to_go - baselines[i])


def test_remax_requires_baselines():
    with pytest.raises(ValueError, match="reward_baselines"):
        call("remax", dense_rewards())


def full_kwargs(seed=0):
    return dict(
        token_level_rewards=torch.tensor(dense_rewards(seed)),
        response_mask=torch.tensor(MASK).bool(),
        group_ids=np.array(["x", "y", "x", "y", "x", "z"]),
        values=torch.tensor(dense_rewards(seed + 1)),
        reward_baselines=torch.zeros(B, dtype=torch.float64),
        teacher_log_probs=torch.tensor(dense_rewards(seed + 2))
        - 3.0,  # OPD's: log-probs of the sampled tokens
        student_log_probs=torch.tensor(dense_rewards(seed + 3)) - 3.0,
        gamma=0.99,
        lam=0.95,
        norm_adv_by_std_in_grpo=True,
        epsilon=1e-6,
    )


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_uniform_signature_finite_and_zero_outside_mask(name):
    kwargs = full_kwargs()
    if name == "grpo_passk":  # needs two samples in every group: the singleton "z" joins "y"
        kwargs["group_ids"] = np.array(["x", "y", "x", "y", "x", "y"])
    adv, ret = ADVANTAGE_ESTIMATORS[name](AdvantageInputs(**kwargs))
    assert adv.shape == ret.shape == (B, T)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    outside = ~torch.tensor(MASK).bool()
    assert torch.all(adv[outside] == 0) and torch.all(ret[outside] == 0)
    assert torch.all(adv[5] == 0)  # fully masked row


@pytest.mark.parametrize(
    "name", ["grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk"]
)
def test_group_estimators_require_group_ids(name):
    kwargs = full_kwargs()
    kwargs["group_ids"] = None
    with pytest.raises(ValueError, match="group_ids"):
        ADVANTAGE_ESTIMATORS[name](AdvantageInputs(**kwargs))
    kwargs["group_ids"] = [0, 1]
    with pytest.raises(ValueError, match="group_ids"):
        ADVANTAGE_ESTIMATORS[name](AdvantageInputs(**kwargs))


def test_registry_and_critic_helpers():
    assert set(ADVANTAGE_ESTIMATORS) == {
        "gae",
        "grpo",
        "drgrpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "opo",
        "gpg",
        "grpo_passk",
        "opd",
    }
    assert set(ESTIMATORS_NEEDING_CRITIC) == {"gae"}
    assert needs_critic("gae") and not needs_critic("grpo")
    with pytest.raises(ValueError, match=r"'ppo'.*gae"):
        needs_critic("ppo")
    with pytest.raises(ValueError, match="valid"):
        get_advantage_estimator("GRPO")


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="response_mask"):
        ADVANTAGE_ESTIMATORS["grpo"](
            AdvantageInputs(
                token_level_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 4), group_ids=[0, 0]
            )
        )
