"""Advantage estimators, one small function each of one :class:`AdvantageInputs`.

Every estimator is called with one :class:`AdvantageInputs`::

    advantages, returns = ADVANTAGE_ESTIMATORS[name](
        AdvantageInputs(
            token_level_rewards=...,   # [B, T] float
            response_mask=...,         # [B, T] bool or float
            group_ids=...,             # [B] any hashable per sample (prompt uid); groups need not be contiguous
            values=...,                # [B, T] critic values, or None
            reward_baselines=...,      # [B] ReMax greedy-rollout reward, or None
            gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True, epsilon=1e-6,
            batch_sum=None,            # rank-local data: sums partial sums over the ranks' shares (BatchSum)
        )
    )

and ignores the fields it does not need. With rank-local data each rank passes its share of the batch (whole
prompt groups, so group statistics stay local) and ``batch_sum``: the estimators with batch-wide statistics
(whitening in ``gae``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``; ``gpg``'s alpha) sum their
partial sums over the ranks with it, so every rank gets the advantages of one process. The registry (``estimator_registry``: name and needs in one decorator) also holds OPO, GPG and GRPO pass@k, which live
in :mod:`posttrain.algorithms.outcome_estimators`. Both outputs are ``[B, T]`` in the rewards' dtype and computed
without gradient. Formulas, epsilons and the unbiased standard deviations match verl's ``core_algos`` (the
loop-based ``grpo``/``rloo`` estimators registered under these names). Deliberate differences:

- Every output is exactly 0 outside ``response_mask``. verl leaves non-zero values there for ``gae``
  (whitened advantages and ``returns = advantages + values``) and ``remax``; those entries are never used by a
  masked loss, so only the padding changes.
- ``reinforce_plus_plus`` follows current verl (returns carried through masked spans such as tool-observation
  tokens, verl-project/verl#7278) rather than older releases, which reset the running return at every masked
  token.
"""

from __future__ import annotations

import dataclasses

import torch

from posttrain.algorithms.estimator_registry import (
    ADVANTAGE_ESTIMATORS,
    AdvantageFn,
    AdvantageInputs,
    register_advantage_estimator,
)
from posttrain.algorithms.groups import float_mask, group_index, group_stats
from posttrain.algorithms.masked import masked_whiten
from posttrain.algorithms.names import (  # noqa: F401 (the torch-free table, re-exported for the trainer)
    ESTIMATOR_NEEDS,
    ESTIMATORS_NEEDING_CRITIC,
    GROUP_ESTIMATORS,
    EstimatorNeeds,
    check_implemented,
    estimator_needs,
    needs_critic,
)


@register_advantage_estimator("gae")
@torch.no_grad()
def compute_gae_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (PPO with a critic), as verl's ``gae``.

    Masked positions are skipped: the TD error uses the value of the next *valid* token, so observation spans
    inside a response are transparent. ``returns = GAE + values``; advantages are then whitened over the mask.

    Args:
        token_level_rewards: ``[B, T]``; values: ``[B, T]`` critic values (required); gamma, lam: discount and
            GAE lambda.

    Returns:
        ``(advantages [B, T] whitened, returns [B, T])``, both 0 outside the mask.
    """
    token_level_rewards, values, gamma = inputs.token_level_rewards, inputs.values, inputs.gamma
    mask = float_mask(token_level_rewards, inputs.response_mask)
    if values is None:
        raise ValueError("advantage estimator 'gae' needs critic values; got values=None")
    if values.shape != token_level_rewards.shape:
        raise ValueError(
            f"values shape {tuple(values.shape)} != rewards shape {tuple(token_level_rewards.shape)}"
        )
    values = values.to(token_level_rewards.dtype)
    next_value = torch.zeros_like(token_level_rewards[:, 0])
    running = torch.zeros_like(next_value)
    gaes = torch.zeros_like(token_level_rewards)
    for t in reversed(range(token_level_rewards.shape[1])):
        m = mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        running = m * (delta + gamma * inputs.lam * running) + (1 - m) * running
        next_value = m * values[:, t] + (1 - m) * next_value
        gaes[:, t] = running
    returns = (gaes + values) * mask
    advantages = masked_whiten(gaes, mask, batch_sum=inputs.batch_sum) * mask
    return advantages, returns


@register_advantage_estimator("grpo")
@torch.no_grad()
def compute_grpo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage, as verl's ``grpo``: ``(r_i - mean_g) / (std_g + epsilon)`` per group.

    ``r_i`` is the row sum of ``token_level_rewards``; ``std_g`` is the unbiased (``torch.std``) group std.
    With ``norm_adv_by_std_in_grpo=False`` only the mean is subtracted (Dr.GRPO). Identical rewards in a group
    give 0; a group of one sample gets ``score / (1 + epsilon)`` (mean 0, std 1, as verl).

    Returns:
        ``(advantages, returns)``, the same ``[B, T]`` tensor twice: the scalar broadcast over the mask.
    """
    token_level_rewards = inputs.token_level_rewards
    mask = float_mask(token_level_rewards, inputs.response_mask)
    scores = token_level_rewards.sum(dim=-1)
    index = group_index(inputs.group_ids, scores.shape[0], scores.device)
    mean, std, _count = group_stats(scores, index)
    centred = scores - mean
    scalars = centred / (std + inputs.epsilon) if inputs.norm_adv_by_std_in_grpo else centred
    advantages = scalars.unsqueeze(-1) * mask
    return advantages, advantages


@register_advantage_estimator("drgrpo")
def compute_drgrpo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO: :func:`compute_grpo_advantages` with ``norm_adv_by_std_in_grpo`` forced to False.

    The other half of Dr.GRPO is the loss aggregation ``seq-mean-token-sum-norm``; see
    :data:`RECOMMENDED_LOSS_AGG_MODE`. In verl this is ``grpo`` plus ``norm_adv_by_std_in_grpo=False``.
    """
    return compute_grpo_advantages(dataclasses.replace(inputs, norm_adv_by_std_in_grpo=False))


@register_advantage_estimator("rloo")
@torch.no_grad()
def compute_rloo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO, as verl's ``rloo``: ``r_i - mean(r_j, j != i)`` = ``n / (n - 1) * (r_i - mean_g)``.

    A group of one sample keeps its raw score (verl's loop implementation; its ``rloo_vectorized`` gives 0).

    Returns:
        ``(advantages, returns)``, the same ``[B, T]`` tensor twice.
    """
    token_level_rewards = inputs.token_level_rewards
    mask = float_mask(token_level_rewards, inputs.response_mask)
    scores = token_level_rewards.sum(dim=-1)
    index = group_index(inputs.group_ids, scores.shape[0], scores.device)
    mean, _std, count = group_stats(scores, index)
    loo = (scores - mean) * count / (count - 1).clamp(min=1)
    scalars = torch.where(count > 1, loo, scores)
    advantages = scalars.unsqueeze(-1) * mask
    return advantages, advantages


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go over valid tokens ``[B, T]``; masked tokens are skipped (their reward ignored), return 0."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        running = m * (rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running * m
    return returns


@register_advantage_estimator("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++, as verl's ``reinforce_plus_plus``: discounted returns whitened over the whole batch.

    Returns:
        ``(advantages [B, T], returns [B, T])``; returns are the un-whitened discounted reward-to-go.
    """
    token_level_rewards = inputs.token_level_rewards
    mask = float_mask(token_level_rewards, inputs.response_mask)
    returns = _discounted_returns(token_level_rewards, mask, inputs.gamma)
    advantages = masked_whiten(returns, mask, batch_sum=inputs.batch_sum) * mask
    return advantages, returns


@register_advantage_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantages(
    inputs: AdvantageInputs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline, as verl's ``reinforce_plus_plus_baseline``.

    Subtract the group mean of the outcome score (0 for a group of one), broadcast over the mask, then whiten
    over all valid tokens of the batch.

    Returns:
        ``(advantages, returns)``, the same ``[B, T]`` tensor twice.
    """
    token_level_rewards = inputs.token_level_rewards
    mask = float_mask(token_level_rewards, inputs.response_mask)
    scores = token_level_rewards.sum(dim=-1)
    index = group_index(inputs.group_ids, scores.shape[0], scores.device)
    mean, _std, _count = group_stats(scores, index)
    centred = (scores - mean).unsqueeze(-1) * mask
    advantages = masked_whiten(centred, mask, batch_sum=inputs.batch_sum) * mask
    return advantages, advantages


@register_advantage_estimator("remax")
@torch.no_grad()
def compute_remax_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax, as verl's ``remax``: undiscounted reward-to-go minus the greedy rollout's reward.

    Args:
        reward_baselines: ``[B]`` reward of the greedy (argmax) response to the same prompt (required).

    Returns:
        ``(advantages [B, T], returns [B, T])``.
    """
    token_level_rewards, reward_baselines = inputs.token_level_rewards, inputs.reward_baselines
    mask = float_mask(token_level_rewards, inputs.response_mask)
    if reward_baselines is None:
        raise ValueError("advantage estimator 'remax' needs reward_baselines (greedy rewards [B]); got None")
    baselines = torch.as_tensor(
        reward_baselines, dtype=token_level_rewards.dtype, device=mask.device
    ).reshape(-1)
    if baselines.shape[0] != mask.shape[0]:
        raise ValueError(
            f"reward_baselines has {baselines.shape[0]} entries but the batch has {mask.shape[0]} rows"
        )
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1]) * mask
    advantages = returns - baselines.unsqueeze(-1) * mask
    return advantages, returns


# OPO, GPG and GRPO pass@k, then on-policy distillation, register themselves (after the estimators above: the
# names keep their order).
from posttrain.algorithms import outcome_estimators  # noqa: E402, F401, I001
from posttrain.algorithms import distill  # noqa: E402, F401

check_implemented("advantage estimator", ESTIMATOR_NEEDS, ADVANTAGE_ESTIMATORS)

RECOMMENDED_LOSS_AGG_MODE: dict[str, str] = {"drgrpo": "seq-mean-token-sum-norm"}
"""Loss aggregation an estimator's paper prescribes (a default for the config layer, not enforced here)."""


def get_advantage_estimator(name: str) -> AdvantageFn:
    """Look up an estimator; ValueError naming ``name`` and the valid keys if unknown."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"adv_estimator={name!r} is not supported; valid: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]
