"""Deterministic, resumable prompt batches."""

from __future__ import annotations

from typing import Any

import torch


class PromptSampler:
    """Yields batches of record indices forever, reshuffling every epoch.

    The order of epoch ``e`` is ``torch.randperm(num_records)`` drawn from a generator seeded with
    ``seed + e``, so it depends only on ``(seed, epoch)``: a run resumed from :meth:`state_dict` yields
    exactly the batches the uninterrupted run would have yielded.

    With ``drop_last=True`` every batch has ``batch_size`` indices and the tail of an epoch that cannot
    fill one is skipped; with ``drop_last=False`` the last batch of an epoch may be smaller.
    """

    def __init__(self, num_records: int, batch_size: int, seed: int, drop_last: bool = True) -> None:
        if num_records < 1:
            raise ValueError(f"num_records={num_records} must be >= 1; the prompt data set is empty")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if batch_size > num_records:
            raise ValueError(
                f"batch_size={batch_size} is larger than num_records={num_records}; "
                f"use batch_size <= {num_records} or more prompt data"
            )
        self.num_records = num_records
        self.batch_size = batch_size
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # index into this epoch's permutation of the next record to yield
        self._order: list[int] | None = None  # cached permutation of self.epoch

    @property
    def batches_per_epoch(self) -> int:
        """Number of batches in one pass over the records."""
        full, rest = divmod(self.num_records, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            self._order = torch.randperm(self.num_records, generator=generator).tolist()
        return self._order

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0
        self._order = None

    def next_batch(self) -> list[int]:
        """The next batch of indices into the records; rolls over to a new epoch as needed."""
        remaining = self.num_records - self.position
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self._next_epoch()
        order = self._epoch_order()
        batch = order[self.position : self.position + self.batch_size]
        self.position += len(batch)
        return batch

    def __iter__(self) -> PromptSampler:
        return self

    def __next__(self) -> list[int]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the same sequence of batches."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_records": self.num_records,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the seed and data-set size must match the run that saved it."""
        for key in ("seed", "num_records"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]} but this sampler has {key}={getattr(self, key)}; "
                    "resume with the same seed and prompt data, or start a fresh run"
                )
        if not 0 <= state["position"] <= self.num_records:
            raise ValueError(f"sampler state position={state['position']} is outside [0, {self.num_records}]")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = None
