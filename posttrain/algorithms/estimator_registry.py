"""The advantage estimators' registry: each estimator registers its config name and what it needs in one place,
``@register_advantage_estimator(name, groups=True)``, and a name registered twice is refused. Every estimator is
a function of one :class:`AdvantageInputs`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from posttrain.algorithms.groups import GroupIds
from posttrain.algorithms.masked import BatchSum


@dataclass(frozen=True)
class AdvantageInputs:
    """What every advantage estimator reads; each one ignores the fields it does not need.

    token_level_rewards: ``[B, T]`` float. response_mask: ``[B, T]`` bool or float. group_ids: ``[B]`` any
    hashable per sample (the prompt's uid); groups need not be contiguous. values: ``[B, T]`` critic values.
    reward_baselines: ``[B]`` the greedy response's reward (ReMax). teacher_log_probs, student_log_probs:
    ``[B, T]`` the distillation teacher's and the student's log-probs of the sampled tokens (OPD). batch_sum: with rank-local data, sums partial
    sums over the ranks' shares (:class:`posttrain.algorithms.masked.BatchSum`).
    """

    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    group_ids: GroupIds = None
    values: torch.Tensor | None = None
    reward_baselines: torch.Tensor | None = None
    teacher_log_probs: torch.Tensor | None = None
    student_log_probs: torch.Tensor | None = None
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    epsilon: float = 1e-6
    batch_sum: BatchSum | None = None


AdvantageFn = Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class EstimatorNeeds:
    """What an estimator needs from the rest of the step besides rewards.

    critic: per-token values from a trained value model.
    groups: several samples of each prompt (rollout.n >= 2): it compares a sample with its group.
    greedy_baseline: the reward of one greedy response per prompt (ReMax's baseline).
    teacher: a distillation teacher's log-probs of the sampled tokens (``distill.teacher``).
    """

    critic: bool = False
    groups: bool = False
    greedy_baseline: bool = False
    teacher: bool = False


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}
"""Every estimator by its config name (`algorithm.adv_estimator`): the single source of the names."""

ESTIMATOR_NEEDS: dict[str, EstimatorNeeds] = {}
"""What each registered estimator needs (filled by the same registration)."""


def register_advantage_estimator(
    name: str,
    *,
    critic: bool = False,
    groups: bool = False,
    greedy_baseline: bool = False,
    teacher: bool = False,
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register the decorated function as estimator ``name`` with what it needs."""

    def register(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"advantage estimator {name!r} is registered twice ({ADVANTAGE_ESTIMATORS[name].__qualname__} "
                f"and {fn.__qualname__}); give the new one another name"
            )
        ADVANTAGE_ESTIMATORS[name] = fn
        ESTIMATOR_NEEDS[name] = EstimatorNeeds(
            critic=critic, groups=groups, greedy_baseline=greedy_baseline, teacher=teacher
        )
        return fn

    return register
