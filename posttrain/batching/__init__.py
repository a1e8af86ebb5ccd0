"""Batch splitting: micro-batches with globally normalised losses (see :mod:`posttrain.batching.micro`)."""

from posttrain.batching.micro import backward_micro_batches, split_micro_batches

__all__ = ["backward_micro_batches", "split_micro_batches"]
