"""Truncation masking (algorithm.mask_truncated_samples): exactly the rows cut off at the limit leave the loss."""

import pytest
import torch

from posttrain.config.errors import ConfigError
from posttrain.data.batch import build_rollout_batch
from posttrain.rl.collect.generation import place_scores
from posttrain.rl.collect.truncation import mask_truncated


def batch_of(lengths):
    return build_rollout_batch(
        [[1, 2]] * len(lengths), [[5] * n for n in lengths], list(range(len(lengths))), 0
    )


def test_exactly_the_truncated_rows_are_masked_and_their_scores_stay():
    batch = batch_of([3, 4, 2, 4])
    batch.token_level_scores = place_scores(batch, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    before = batch.response_mask.clone()
    metrics = mask_truncated(batch, ["eos", "length", "eos", "length"])
    assert metrics == {"finish/num_masked_truncated": 2.0}
    assert torch.equal(batch.response_mask[[0, 2]], before[[0, 2]])
    assert batch.response_mask[[1, 3]].sum() == 0
    assert batch.token_level_scores.sum(-1).tolist() == [1.0, 2.0, 3.0, 4.0]  # group baselines still see them


def test_nothing_truncated_changes_nothing():
    batch = batch_of([1, 2])
    before = batch.response_mask.clone()
    assert mask_truncated(batch, ["eos", "eos"]) == {"finish/num_masked_truncated": 0.0}
    assert torch.equal(batch.response_mask, before)


def test_a_step_with_every_response_truncated_is_a_clear_error():
    with pytest.raises(
        ConfigError, match="algorithm.mask_truncated_samples=true.*data.max_response_length=3"
    ):
        mask_truncated(batch_of([3, 3]), ["length", "length"])
