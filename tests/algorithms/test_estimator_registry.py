"""One registration per advantage estimator: its name and needs together, and a name taken twice is refused."""

import pytest

from posttrain.algorithms.advantages import ADVANTAGE_ESTIMATORS, ESTIMATOR_NEEDS, compute_grpo_advantages
from posttrain.algorithms.estimator_registry import register_advantage_estimator


def test_every_estimator_has_its_needs():
    assert list(ESTIMATOR_NEEDS) == list(ADVANTAGE_ESTIMATORS)
    assert ESTIMATOR_NEEDS["gae"].critic and ESTIMATOR_NEEDS["remax"].greedy_baseline
    assert ESTIMATOR_NEEDS["grpo_passk"].groups and not ESTIMATOR_NEEDS["reinforce_plus_plus"].groups


def test_a_name_registered_twice_is_refused():
    before = dict(ADVANTAGE_ESTIMATORS)
    with pytest.raises(ValueError, match="advantage estimator 'grpo' is registered twice"):
        register_advantage_estimator("grpo", groups=True)(compute_grpo_advantages)
    assert before == ADVANTAGE_ESTIMATORS
