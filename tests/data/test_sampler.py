"""PromptSampler: determinism, epoch roll-over and exact resume."""

import itertools

import pytest

from posttrain.data.sampler import PromptSampler


def take(sampler, n):
    return list(itertools.islice(sampler, n))


def test_epochs_are_permutations_and_deterministic():
    sampler = PromptSampler(num_records=10, batch_size=5, seed=3)
    batches = take(sampler, 6)
    for epoch in range(3):
        assert sorted(batches[2 * epoch] + batches[2 * epoch + 1]) == list(range(10))
    assert batches[:2] != batches[2:4]  # reshuffled each epoch
    assert take(PromptSampler(10, 5, seed=3), 6) == batches
    assert take(PromptSampler(10, 5, seed=4), 6) != batches


def test_drop_last():
    dropped = PromptSampler(num_records=7, batch_size=3, seed=0)
    assert [len(b) for b in take(dropped, 4)] == [3, 3, 3, 3]
    assert dropped.batches_per_epoch == 2 and dropped.epoch == 1
    kept = PromptSampler(num_records=7, batch_size=3, seed=0, drop_last=False)
    assert [len(b) for b in take(kept, 4)] == [3, 3, 1, 3]
    assert kept.batches_per_epoch == 3


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("drop_last", [True, False])
def test_resume_equals_uninterrupted(stop_after, drop_last):
    reference = take(PromptSampler(11, 4, seed=7, drop_last=drop_last), 12)
    first = PromptSampler(11, 4, seed=7, drop_last=drop_last)
    head = take(first, stop_after)
    resumed = PromptSampler(11, 4, seed=7, drop_last=drop_last)
    resumed.load_state_dict(first.state_dict())
    assert head + take(resumed, 12 - stop_after) == reference


def test_errors_name_parameters():
    with pytest.raises(ValueError, match="batch_size=8 is larger than num_records=5"):
        PromptSampler(num_records=5, batch_size=8, seed=0)
    state = PromptSampler(5, 2, seed=0).state_dict()
    with pytest.raises(ValueError, match="seed=0 but this sampler has seed=1"):
        PromptSampler(5, 2, seed=1).load_state_dict(state)
