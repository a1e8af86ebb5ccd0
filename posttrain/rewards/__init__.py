"""Rewards: rule functions (``functions``), a safe batch runner (``runner``) and reward models
(``reward_model``, imported on demand because it loads torch models)."""

from posttrain.rewards.functions import (
    REWARD_FUNCTIONS,
    RewardFn,
    exact_match_reward,
    resolve_reward_function,
)
from posttrain.rewards.runner import RewardInput, RewardRunner

__all__ = [
    "REWARD_FUNCTIONS",
    "RewardFn",
    "RewardInput",
    "RewardRunner",
    "exact_match_reward",
    "resolve_reward_function",
]
