"""The one epoch/step schedule of `posttrain sft`, `posttrain rm` and `posttrain explain rm`."""

import pytest
import torch

from posttrain.batching.epochs import EpochSchedule
from posttrain.config.load import build_config
from posttrain.config.plan import build_sft_plan
from posttrain.rm.loop import rm_schedule
from posttrain.sft.loop import sft_schedule


@pytest.mark.parametrize("shuffle", ["seed_per_epoch", "one_generator"])
def test_steps_epochs_and_the_cap(shuffle):
    s = EpochSchedule(num_items=10, batch_size=3, epochs=2, seed=5, shuffle=shuffle)
    assert (s.steps_per_epoch, s.left_out_per_epoch, s.total_steps) == (3, 1, 6)
    assert EpochSchedule(num_items=10, batch_size=3, epochs=2, seed=5, max_steps=4).total_steps == 4
    assert EpochSchedule(num_items=10, batch_size=3, epochs=2, seed=5, max_steps=9).total_steps == 6
    for epoch in range(2):
        taken = [i for k in range(1, 4) for i in s.indices(epoch * 3 + k)]
        assert len(set(taken)) == 9 and taken == s.order(epoch)[:9]  # one pass, the last item left out


def test_each_shuffle_draws_as_its_command_always_did():
    """rm: a generator seeded with seed + epoch; sft: successive permutations of one generator seeded once."""
    per_epoch = EpochSchedule(num_items=7, batch_size=2, epochs=3, seed=4)
    one = EpochSchedule(num_items=7, batch_size=2, epochs=3, seed=4, shuffle="one_generator")
    gen = torch.Generator().manual_seed(4)
    for epoch in range(3):
        assert (
            per_epoch.order(epoch)
            == torch.randperm(7, generator=torch.Generator().manual_seed(4 + epoch)).tolist()
        )
        assert one.order(epoch) == torch.randperm(7, generator=gen).tolist()


def test_rm_and_sft_build_it_from_their_sections():
    cfg = build_config(
        overrides=[
            "rm.batch_size=4",
            "rm.epochs=3",
            "rm.max_steps=5",
            "sft.batch_size=8",
            "sft.epochs=2",
            "sft.micro_batch_size_per_gpu=4",
            "sft.max_steps=0",
            "trainer.seed=9",
        ]
    )
    rm = rm_schedule(cfg, 10)
    assert (rm.steps_per_epoch, rm.total_steps, rm.seed, rm.shuffle) == (2, 5, 9, "seed_per_epoch")
    sft = sft_schedule(cfg.trainer.seed, 20, build_sft_plan(cfg), cfg.sft.max_steps)
    assert (sft.steps_per_epoch, sft.total_steps, sft.shuffle) == (2, 4, "one_generator")
