"""The sampled-token OPD advantage: the formula on hand-computed cases, as an estimator and as a weighted term
added to another estimator's advantages, and the metrics' per-token sums."""

import math

import pytest
import torch

from posttrain.algorithms.advantages import AdvantageInputs, estimator_needs, get_advantage_estimator
from posttrain.algorithms.distill import add_opd_advantage, distill_sums, opd_advantage

# Two samples, three response columns; the second sample's last column is padding, and its middle column an
# environment token (mask 0): neither is trained, so both get 0 whatever the log-probs say there.
TEACHER = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.9)], [math.log(0.1), -3.0, -7.0]])
STUDENT = torch.tensor([[math.log(0.25), math.log(0.5), math.log(0.9)], [math.log(0.4), -1.0, -2.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
# log(0.5/0.25) = log 2, log(0.25/0.5) = -log 2, 0; log(0.1/0.4) = -log 4; masked: 0.
EXPECTED = torch.tensor([[math.log(2), -math.log(2), 0.0], [-math.log(4), 0.0, 0.0]])


def test_opd_advantage_is_teacher_minus_student_on_trained_tokens():
    torch.testing.assert_close(opd_advantage(TEACHER, STUDENT, MASK), EXPECTED)


def test_opd_estimator_ignores_rewards_and_needs_a_teacher():
    rewards = torch.tensor([[0.0, 0.0, 5.0], [0.0, 0.0, -5.0]])
    inputs = AdvantageInputs(rewards, MASK, teacher_log_probs=TEACHER, student_log_probs=STUDENT)
    advantages, returns = get_advantage_estimator("opd")(inputs)
    torch.testing.assert_close(advantages, EXPECTED)
    torch.testing.assert_close(returns, EXPECTED)
    needs = estimator_needs("opd")
    assert needs.teacher and not needs.groups and not needs.critic
    with pytest.raises(ValueError, match="teacher and student"):
        get_advantage_estimator("opd")(AdvantageInputs(rewards, MASK))


def test_opd_term_is_added_with_its_weight_to_any_estimators_advantages():
    base = torch.tensor([[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]])
    torch.testing.assert_close(add_opd_advantage(base, TEACHER, STUDENT, MASK, 0.5), base + 0.5 * EXPECTED)
    torch.testing.assert_close(add_opd_advantage(base, TEACHER, STUDENT, MASK, 0.0), base)


def test_no_gradient_flows_through_the_advantage():
    teacher, student = TEACHER.clone().requires_grad_(), STUDENT.clone().requires_grad_()
    assert not opd_advantage(teacher, student, MASK).requires_grad


def test_the_teacher_equal_to_the_student_gives_zero():
    assert torch.equal(opd_advantage(STUDENT, STUDENT, MASK), torch.zeros_like(MASK))


def test_metric_sums_are_per_trained_token():
    in_top_k = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    sums = distill_sums(TEACHER, STUDENT, MASK, in_top_k)
    assert sums["tokens"] == 4.0
    assert sums["reverse_kl"] == pytest.approx(float(-EXPECTED.sum()), abs=1e-6)  # log 4
    assert sums["teacher_logprob"] == pytest.approx(math.log(0.5 * 0.25 * 0.9 * 0.1), abs=1e-6)
    assert sums["top_k_overlap"] == 3.0
    assert "top_k_overlap" not in distill_sums(TEACHER, STUDENT, MASK)


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="one \\[B, T\\]"):
        opd_advantage(TEACHER, STUDENT[:, :2], MASK)
