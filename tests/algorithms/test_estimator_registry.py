"""One registration per advantage estimator, under a name declared with its needs in the torch-free table; an
undeclared name or a name taken twice is refused."""

import pytest

from posttrain.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_grpo_advantages
from posttrain.algorithms.estimator_registry import register_advantage_estimator
from posttrain.algorithms.names import ESTIMATOR_NEEDS, POLICY_LOSS_NAMES, check_implemented
from posttrain.algorithms.policy_loss import POLICY_LOSSES


def test_every_declared_estimator_is_implemented_in_order():
    assert list(ESTIMATOR_NEEDS) == list(ADVANTAGE_ESTIMATORS)
    assert list(POLICY_LOSS_NAMES) == list(POLICY_LOSSES)
    assert ESTIMATOR_NEEDS["gae"].critic and ESTIMATOR_NEEDS["remax"].greedy_baseline
    assert ESTIMATOR_NEEDS["grpo_passk"].groups and not ESTIMATOR_NEEDS["reinforce_plus_plus"].groups


def test_a_name_registered_twice_is_refused():
    before = dict(ADVANTAGE_ESTIMATORS)
    with pytest.raises(ValueError, match="advantage estimator 'grpo' is registered twice"):
        register_advantage_estimator("grpo")(compute_grpo_advantages)
    assert before == ADVANTAGE_ESTIMATORS


def test_an_undeclared_name_is_refused():
    with pytest.raises(ValueError, match="'grpo2' .* is not declared; add it with its needs"):
        register_advantage_estimator("grpo2")(compute_grpo_advantages)
    assert "grpo2" not in ADVANTAGE_ESTIMATORS


def test_a_registry_out_of_step_with_the_table_fails_at_import():
    with pytest.raises(RuntimeError, match="policy loss names declared"):
        check_implemented("policy loss", ("vanilla", "gspo"), ("vanilla",))
