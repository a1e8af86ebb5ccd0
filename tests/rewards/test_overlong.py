"""Overlong reward shaping (reward.overlong_buffer): the penalty of hand-computed lengths."""

import pytest
import torch

from posttrain.rewards.overlong import OverlongBuffer, overlong_metrics


def test_penalty_grows_linearly_over_the_buffer():
    # Budget 20, buffer 8: free up to 12 tokens, then -factor * (L - 12) / 8 down to -factor at 20.
    shaping = OverlongBuffer(max_response_length=20, buffer_len=8, penalty_factor=0.5)
    lengths = [0, 5, 12, 13, 16, 19, 20]
    expected = [0.0, 0.0, 0.0, -0.0625, -0.25, -0.4375, -0.5]
    assert shaping.penalties(lengths).tolist() == pytest.approx(expected)
    assert shaping.penalties(torch.tensor(lengths)).dtype == torch.float32


def test_buffer_as_wide_as_the_budget_penalises_every_token():
    shaping = OverlongBuffer(max_response_length=4, buffer_len=4, penalty_factor=1.0)
    assert shaping.penalties([1, 2, 4]).tolist() == pytest.approx([-0.25, -0.5, -1.0])


def test_zero_factor_changes_nothing():
    assert (OverlongBuffer(8, 2, 0.0).penalties([8, 7, 1]) == 0).all()


def test_metrics_count_the_penalised_responses():
    metrics = overlong_metrics(OverlongBuffer(8, 4, 1.0).penalties([2, 4, 6, 8]))
    assert metrics == {"reward/overlong_penalty_mean": pytest.approx(-0.375), "reward/overlong_fraction": 0.5}
    assert overlong_metrics(torch.zeros(0))["reward/overlong_fraction"] == 0.0


@pytest.mark.parametrize(("buffer_len", "factor"), [(0, 1.0), (9, 1.0), (4, -1.0)])
def test_bad_arguments_are_named(buffer_len, factor):
    with pytest.raises(ValueError, match="buffer_len|penalty_factor"):
        OverlongBuffer(8, buffer_len, factor)
