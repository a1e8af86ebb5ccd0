"""The advantage estimators' registry: each estimator registers its config name and what it needs in one place,
``@register_advantage_estimator(name, groups=True)``, and a name registered twice is refused."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class EstimatorNeeds:
    """What an estimator needs from the rest of the step besides rewards.

    critic: per-token values from a trained value model.
    groups: several samples of each prompt (rollout.n >= 2): it compares a sample with its group.
    greedy_baseline: the reward of one greedy response per prompt (ReMax's baseline).
    """

    critic: bool = False
    groups: bool = False
    greedy_baseline: bool = False


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}
"""Every estimator by its config name (`algorithm.adv_estimator`): the single source of the names."""

ESTIMATOR_NEEDS: dict[str, EstimatorNeeds] = {}
"""What each registered estimator needs (filled by the same registration)."""


def register_advantage_estimator(
    name: str, *, critic: bool = False, groups: bool = False, greedy_baseline: bool = False
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register the decorated function as estimator ``name`` with what it needs."""

    def register(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"advantage estimator {name!r} is registered twice ({ADVANTAGE_ESTIMATORS[name].__qualname__} "
                f"and {fn.__qualname__}); give the new one another name"
            )
        ADVANTAGE_ESTIMATORS[name] = fn
        ESTIMATOR_NEEDS[name] = EstimatorNeeds(critic=critic, groups=groups, greedy_baseline=greedy_baseline)
        return fn

    return register
