"""Further outcome (group) advantage estimators: OPO, GPG and GRPO pass@k, under verl's registered names.

Each takes one :class:`~posttrain.algorithms.estimator_registry.AdvantageInputs`, as the estimators of
:mod:`posttrain.algorithms.advantages` do (fields it does not need are ignored). Each one reduces a sample to its outcome score ``r_i`` (the row sum of
``token_level_rewards``), turns the scores of a prompt group into one scalar per sample, and broadcasts that
scalar over the sample's response tokens; it is exactly 0 outside ``response_mask``. ``returns`` is the same
tensor as ``advantages``, as for verl's other outcome estimators.
"""

from __future__ import annotations

import torch

from posttrain.algorithms.estimator_registry import AdvantageInputs, register_advantage_estimator
from posttrain.algorithms.groups import float_mask, group_index, group_stats, group_sum, num_groups


@register_advantage_estimator("opo")
@torch.no_grad()
def compute_opo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (On-Policy RL with Optimal reward baseline), as verl's ``opo``: a length-weighted group baseline.

    With ``l_i`` the number of valid response tokens of sample ``i``, the baseline of group ``g`` is
    ``b_g = sum_i l_i * r_i / sum_i l_i`` and the advantage is ``r_i - b_g``; there is no std scaling
    (``norm_adv_by_std_in_grpo`` is ignored, as in verl). A group of one sample has baseline 0, so it keeps its
    score. A group whose samples are all fully masked has baseline 0 too (verl divides 0 by 0 there; every
    token of such a group is masked, so only the padding differs).

    Returns:
        ``(advantages, returns)``, the same ``[B, T]`` tensor twice.
    """
    token_level_rewards = inputs.token_level_rewards
    mask = float_mask(token_level_rewards, inputs.response_mask)
    scores = token_level_rewards.sum(dim=-1)
    lengths = mask.sum(dim=-1)
    index = group_index(inputs.group_ids, scores.shape[0], scores.device)
    count = group_sum(torch.ones_like(scores), index)
    total_length = group_sum(lengths, index)
    weighted = group_sum(lengths * scores, index)
    usable = (count > 1) & (total_length > 0)
    baseline = torch.where(usable, weighted / torch.where(usable, total_length, 1.0), 0.0)
    advantages = (scores - baseline[index]).unsqueeze(-1) * mask
    return advantages, advantages


@register_advantage_estimator("gpg")
@torch.no_grad()
def compute_gpg_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Group Policy Gradient), as verl's ``gpg``: the group-centred score, scaled up by ``alpha``.

    ``A_i = alpha * (r_i - mean_g)`` with ``alpha = B / max(M, 1)``, where ``B`` is the number of samples in the
    batch and ``M`` the number of samples whose score is non-zero (counted over the whole batch, not per group;
    over every rank's share with ``batch_sum``).
    The scaling compensates for samples that carry no signal. No std scaling (``norm_adv_by_std_in_grpo`` is
    ignored, as in verl); verl's ``f_norm`` divisor is fixed at 1 there and is left out here. A group of one
    sample has mean 0 (verl's convention), so its advantage is ``alpha * r_i``.

    The GPG paper pairs this estimator with a plain policy-gradient loss: set ``actor.policy_loss=gpg``.

    Returns:
        ``(advantages, returns)``, the same ``[B, T]`` tensor twice.
    """
    token_level_rewards, batch_sum = inputs.token_level_rewards, inputs.batch_sum
    mask = float_mask(token_level_rewards, inputs.response_mask)
    scores = token_level_rewards.sum(dim=-1)
    index = group_index(inputs.group_ids, scores.shape[0], scores.device)
    mean, _std, _count = group_stats(scores, index)
    samples, nonzero = scores.shape[0], int(torch.count_nonzero(scores).item())
    if batch_sum is not None:  # alpha counts over the whole batch
        samples, nonzero = (int(v) for v in batch_sum(torch.tensor([samples, nonzero], dtype=torch.float64)))
    alpha = samples / max(nonzero, 1)
    advantages = (alpha * (scores - mean)).unsqueeze(-1) * mask
    return advantages, advantages


@register_advantage_estimator("grpo_passk")
@torch.no_grad()
def compute_grpo_passk_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO for pass@k, as verl's ``grpo_passk``: only the best sample of each group is credited.

    In each group the sample with the highest score gets ``r_max - r_second`` (the margin over the runner-up),
    divided by ``std_g + epsilon`` (unbiased group std) when ``norm_adv_by_std_in_grpo`` is set; every other
    sample gets 0. When the top score is shared the margin is 0, so the whole group gets 0 (which of the tied
    samples is "best" does not matter; the first one is taken). Every group needs at least two samples: a group
    of one raises ValueError, as in verl.

    Returns:
        ``(advantages, returns)``, the same ``[B, T]`` tensor twice.
    """
    token_level_rewards = inputs.token_level_rewards
    mask = float_mask(token_level_rewards, inputs.response_mask)
    scores = token_level_rewards.sum(dim=-1)
    batch = scores.shape[0]
    index = group_index(inputs.group_ids, batch, scores.device)
    _mean, std, count = group_stats(scores, index)
    if bool((count < 2).any()):
        row = int(torch.nonzero(count < 2)[0].item())
        raise ValueError(
            f"grpo_passk needs at least 2 samples in every group; the group of row {row} has "
            f"{int(count[row].item())} (use rollout.n >= 2)"
        )
    no_score = torch.full((num_groups(index),), float("-inf"), dtype=scores.dtype, device=scores.device)
    best = no_score.scatter_reduce(0, index, scores, reduce="amax")
    rows = torch.arange(batch, device=scores.device)
    candidates = torch.where(scores == best[index], rows, batch)
    first_best = torch.full_like(best, batch, dtype=torch.long).scatter_reduce(0, index, candidates, "amin")
    is_best = rows == first_best[index]
    runner_up = no_score.scatter_reduce(0, index, scores.masked_fill(is_best, float("-inf")), reduce="amax")
    margin = (best - runner_up)[index]
    if inputs.norm_adv_by_std_in_grpo:
        margin = margin / (std + inputs.epsilon)
    scalars = torch.where(is_best, margin, torch.zeros_like(margin))
    advantages = scalars.unsqueeze(-1) * mask
    return advantages, advantages
