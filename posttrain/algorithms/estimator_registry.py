"""The advantage estimators' registry: each estimator registers its function under its config name,
``@register_advantage_estimator(name)``; the name and what it needs are declared in ``posttrain.algorithms.names``
(torch-free, for the config), and an undeclared name or a name registered twice is refused. Every estimator is
a function of one :class:`AdvantageInputs`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from posttrain.algorithms.groups import GroupIds
from posttrain.algorithms.masked import BatchSum
from posttrain.algorithms.names import ESTIMATOR_NEEDS


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


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}
"""Every estimator's function by its config name, one per name of ``names.ESTIMATOR_NEEDS``."""


def register_advantage_estimator(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register the decorated function as estimator ``name``, declared with its needs in
    ``posttrain.algorithms.names.ESTIMATOR_NEEDS``."""

    def register(fn: AdvantageFn) -> AdvantageFn:
        if name not in ESTIMATOR_NEEDS:
            raise ValueError(
                f"advantage estimator {name!r} ({fn.__qualname__}) is not declared; add it with its needs to "
                "posttrain.algorithms.names.ESTIMATOR_NEEDS"
            )
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"advantage estimator {name!r} is registered twice ({ADVANTAGE_ESTIMATORS[name].__qualname__} "
                f"and {fn.__qualname__}); give the new one another name"
            )
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return register
