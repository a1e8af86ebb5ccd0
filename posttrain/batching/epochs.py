"""Optimizer steps over a fixed set of examples: which examples each step takes, and how many steps a run has.

`posttrain sft` and `posttrain rm` walk their examples (SFT examples, preference pairs) in epochs; `posttrain
explain rm` prints the same arithmetic. Step s (1-based) is position k = (s - 1) mod steps_per_epoch of epoch
e = (s - 1) div steps_per_epoch and takes ``order(e)[k * batch_size : (k + 1) * batch_size]``; the examples
left over at the end of each epoch's shuffle (num_items mod batch_size) are not trained in that epoch.

Every order is a function of the seed and the epoch alone, so a resumed run takes exactly the examples the
uninterrupted run would have taken at each step, without any state in the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

# How each epoch's permutation is drawn. "seed_per_epoch": a generator seeded with seed + epoch (reward models).
# "one_generator": the (epoch + 1)-th permutation of one generator seeded with seed, as SFT has always drawn
# them; kept so that SFT runs, and the built-in model warm-started by SFT, train on the same examples as before.
Shuffle = Literal["seed_per_epoch", "one_generator"]


@dataclass(frozen=True)
class EpochSchedule:
    """``batch_size`` examples per optimizer step, ``epochs`` passes over ``num_items`` examples, at most
    ``max_steps`` steps (0: no cap)."""

    num_items: int
    batch_size: int
    epochs: int
    seed: int
    max_steps: int = 0
    shuffle: Shuffle = "seed_per_epoch"

    def __post_init__(self) -> None:
        # The commands refuse a batch larger than the data with a ConfigError first: this is a bug.
        assert 1 <= self.batch_size <= self.num_items, (self.batch_size, self.num_items)
        assert self.epochs >= 1 and self.max_steps >= 0, (self.epochs, self.max_steps)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_items // self.batch_size

    @property
    def left_out_per_epoch(self) -> int:
        """Examples at the end of each epoch's shuffle that no step of that epoch takes."""
        return self.num_items - self.steps_per_epoch * self.batch_size

    @property
    def total_steps(self) -> int:
        total = self.steps_per_epoch * self.epochs
        return min(total, self.max_steps) if self.max_steps else total

    def order(self, epoch: int) -> list[int]:
        """The permutation of the examples that epoch ``epoch`` (0-based) walks through."""
        if self.shuffle == "seed_per_epoch":
            gen = torch.Generator().manual_seed(self.seed + epoch)
            return torch.randperm(self.num_items, generator=gen).tolist()
        gen = torch.Generator().manual_seed(self.seed)
        for _ in range(epoch):  # the earlier epochs' draws advance the one generator
            torch.randperm(self.num_items, generator=gen)
        return torch.randperm(self.num_items, generator=gen).tolist()

    def indices(self, step: int) -> list[int]:
        """The examples optimizer step ``step`` (1-based) takes."""
        assert 1 <= step <= self.total_steps, (step, self.total_steps)
        epoch, k = divmod(step - 1, self.steps_per_epoch)
        return self.order(epoch)[k * self.batch_size : (k + 1) * self.batch_size]
