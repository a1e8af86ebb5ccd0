"""Combining a rule reward, a reward model's score and a judge's score into the reward a run trains on.

``reward = reward.rule_weight * rule + reward.model.weight * model_score + reward.judge.weight * judge_score
+ reward.prm.weight * prm_score`` (each enabled part; ``judge_score`` in [0, 1] is the judge's weighted mean over
its criteria, win rates in pairwise mode, posttrain.rewards.judge; ``prm_score`` the process reward model's
reduced step scores, or with ``reward.prm.reduction=dense`` their sum, each then placed on its step's last token:
posttrain.rewards.process_reward) where ``model_score`` is the reward
model's output, normalised with the ``reward_mean`` / ``reward_std`` stored in its config when
``reward.model.normalize=true`` (``posttrain rm`` writes them). Both parts are logged on their own every step,
whatever their weights, so a policy that pleases the reward model without being right (reward hacking) shows:

- ``reward/rule_mean``: the mean rule reward; ``reward/rule_accuracy``: the share of samples the rule scores
  >= 1 (right answers for the built-in rules);
- ``reward/model_score_mean``: the mean reward-model score (after normalisation, before the weight);
- ``reward/judge/score_mean``: the mean judge score (before the weight; the judge logs it with its own metrics);
- ``reward/prm/mean``, ``reward/prm/steps``: the mean PRM score (before the weight) and steps per response.

A weight of 0 turns a part off in training; the rule still runs and is logged (it also stays the validation
reward), which is how a run trains on the reward model alone and measures true accuracy beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.config.errors import ConfigError

CORRECT = 1.0  # a rule reward >= this counts as a right answer (posttrain.rl.collect.validation)


@dataclass(frozen=True)
class RewardWeights:
    """How the parts add up (the weights' rules are checked with the config). ``mean``/``std``: the reward model's normalisation (0 and 1: none)."""

    rule: float = 1.0
    model: float = 1.0
    mean: float = 0.0
    std: float = 1.0
    judge: float = 1.0
    prm: float = 1.0

    @classmethod
    def from_config(cls, cfg, model_config=None) -> RewardWeights:
        """The weights of ``cfg.reward`` (``model_config``: the reward model's HF config, for normalisation)."""
        rw = cfg.reward  # the rules between the keys: posttrain.config.validate
        if not (rw.model.enable or rw.judge.enable or rw.prm.enable):
            return cls()
        mean, std = 0.0, 1.0
        if rw.model.enable and rw.model.normalize:
            mean, std = normalisation(model_config, rw.model.path)
        return cls(rw.rule_weight, rw.model.weight, mean, std, rw.judge.weight, rw.prm.weight)


def normalisation(model_config, path: str) -> tuple[float, float]:
    """(reward_mean, reward_std) from a reward model's config, as `posttrain rm` stores them."""
    mean = getattr(model_config, "reward_mean", None)
    std = getattr(model_config, "reward_std", None)
    if mean is None or std is None:
        raise ConfigError(
            f"reward.model.normalize=true: the config of reward.model.path={path} has no reward_mean and "
            "reward_std (`posttrain rm` writes them); set reward.model.normalize=false"
        )
    if not std > 0:
        raise ConfigError(
            f"reward.model.normalize=true: reward.model.path={path} stores reward_std={std}, which cannot "
            "divide; set reward.model.normalize=false"
        )
    return float(mean), float(std)


def combine_rewards(
    rule: torch.Tensor,
    model_scores: torch.Tensor | None,
    weights: RewardWeights,
    judge_scores: torch.Tensor | None = None,
    prm_scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """([S] rewards trained on, the parts' metrics). rule, model_scores, judge_scores, prm_scores: ``[S]``
    float32 (None: no reward model, no judge, no process reward model)."""
    metrics = rule_metrics(rule)
    total = weights.rule * rule
    if model_scores is not None:
        normalised = (model_scores - weights.mean) / weights.std
        metrics["reward/model_score_mean"] = float(normalised.mean()) if len(normalised) else 0.0
        total = total + weights.model * normalised
    if judge_scores is not None:
        total = total + weights.judge * judge_scores
    if prm_scores is not None:
        total = total + weights.prm * prm_scores
    return total, metrics


def rule_metrics(rule: torch.Tensor) -> dict[str, float]:
    """The rule's mean and accuracy (weightless zeros when there is no sample: ranks reduce the names)."""
    if len(rule) == 0:
        return {"reward/rule_mean": 0.0, "reward/rule_accuracy": 0.0}
    return {
        "reward/rule_mean": float(rule.mean()),
        "reward/rule_accuracy": float((rule >= CORRECT).float().mean()),
    }
