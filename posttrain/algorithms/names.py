"""The algorithms' names and what each estimator needs, without torch.

The config schema offers these names as choices and the command line checks a config against them before any
heavy library loads (`posttrain --help` and a misspelled key answer in well under a second). The implementations
register under these names (``estimator_registry``, ``policy_loss``) and refuse a name that is not declared here;
each registry checks at import that every name here has its implementation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


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


_GROUPS = EstimatorNeeds(groups=True)

ESTIMATOR_NEEDS: dict[str, EstimatorNeeds] = {
    "gae": EstimatorNeeds(critic=True),
    "grpo": _GROUPS,
    "drgrpo": _GROUPS,
    "rloo": _GROUPS,
    "reinforce_plus_plus": EstimatorNeeds(),
    "reinforce_plus_plus_baseline": _GROUPS,
    "remax": EstimatorNeeds(greedy_baseline=True),
    "opo": _GROUPS,
    "gpg": _GROUPS,
    "grpo_passk": _GROUPS,
    "opd": EstimatorNeeds(teacher=True),
}
"""Every advantage estimator by its config name (`algorithm.adv_estimator`) with what it needs: the single source
of the names; ``posttrain.algorithms.estimator_registry`` holds the functions."""

ESTIMATORS_NEEDING_CRITIC: frozenset[str] = frozenset(k for k, v in ESTIMATOR_NEEDS.items() if v.critic)
GROUP_ESTIMATORS: frozenset[str] = frozenset(k for k, v in ESTIMATOR_NEEDS.items() if v.groups)

POLICY_LOSS_NAMES: tuple[str, ...] = ("vanilla", "gspo", "gpg")
"""Every policy loss by its config name (`actor.policy_loss.loss_mode`); ``policy_loss.POLICY_LOSSES`` maps them
to their functions."""

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

KL_KINDS: dict[str, str] = {
    "k1": "k1",
    "kl": "k1",
    "abs": "abs",
    "k2": "k2",
    "mse": "k2",
    "k3": "k3",
    "low_var_kl": "k3",
}
"""Each KL estimator name (verl's aliases included) and the estimator it computes."""

KL_ESTIMATORS: list[str] = [*KL_KINDS, *(f"{name}+" for name in KL_KINDS)]
"""Every accepted ``kl_penalty`` / ``kl_loss_type`` name (``+``: the straight-through variant)."""


def estimator_needs(name: str) -> EstimatorNeeds:
    """What estimator ``name`` needs (critic, groups, a greedy baseline); ValueError if unknown."""
    if name not in ESTIMATOR_NEEDS:
        raise ValueError(f"adv_estimator={name!r} is not supported; valid: {sorted(ESTIMATOR_NEEDS)}")
    return ESTIMATOR_NEEDS[name]


def needs_critic(name: str) -> bool:
    """Whether estimator ``name`` needs a value model (critic)."""
    return estimator_needs(name).critic


def check_implemented(kind: str, declared: Iterable[str], implemented: Iterable[str]) -> None:
    """Raise RuntimeError when a declared name has no implementation or an implementation has no declared name
    (a registry out of step with this table is a bug in posttrain, found at import)."""
    declared, implemented = list(declared), list(implemented)
    if declared != implemented:
        raise RuntimeError(
            f"{kind} names declared in posttrain.algorithms.names {declared} differ from the implemented ones "
            f"{implemented}; declare each name once there, in the same order"
        )
