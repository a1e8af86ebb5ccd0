"""Split a mini-batch into micro-batches and accumulate gradients with correct loss scaling.

The contract (why the divisor must be global):

1. Build ONE :class:`~posttrain.algorithms.aggregation.LossNormalizer` from the mask of the *whole* mini-batch
   (all data-parallel ranks) before the first micro-batch.
2. For every micro-batch compute each loss term with ``aggregate_loss(..., normalizer)`` (the policy, value, KL
   and entropy losses all take the normalizer) and call ``.backward()`` on it as is.
3. Do NOT divide by the number of micro-batches (or gradient-accumulation steps), and do not re-normalise by the
   micro-batch's own token or sequence count.

Each micro-batch's loss is then its exact share of the mini-batch loss, so the accumulated gradient equals the
gradient of the whole mini-batch in one piece for every aggregation mode and any split, including uneven ones
(the last micro-batch may be smaller, token-budget micro-batches differ in size). The usual recipe "per-micro-batch
mean, then divide by the number of micro-batches" is only right when every micro-batch has the same number of
valid tokens (token-mean) or sequences (seq-mean modes); otherwise it reweights samples depending on how the
batch happened to be cut.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from posttrain.algorithms.aggregation import LossNormalizer

MicroBatch = dict[str, torch.Tensor]
LossFn = Callable[[MicroBatch, LossNormalizer], tuple[torch.Tensor, Mapping[str, torch.Tensor | float]]]


def split_micro_batches(batch: Mapping[str, torch.Tensor], micro_batch_size: int) -> list[MicroBatch]:
    """Cut a batch of row-aligned tensors into consecutive row slices of ``micro_batch_size`` rows.

    Args:
        batch: tensors that all share the leading (row) dimension ``B``.
        micro_batch_size: rows per micro-batch, >= 1; the last micro-batch holds the remainder.

    Returns:
        ``ceil(B / micro_batch_size)`` dicts with the same keys; the slices are views, not copies.
    """
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be an integer >= 1, got {micro_batch_size!r}")
    if not batch:
        raise ValueError("batch is empty; nothing to split")
    rows = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            raise ValueError(f"batch[{key!r}] must be a tensor with a row dimension, got {type(value).__name__}")
        rows[key] = value.shape[0]
    if len(set(rows.values())) != 1:
        raise ValueError(f"all tensors in batch must have the same number of rows, got {rows}")
    num_rows = next(iter(rows.values()))
    return [
        {key: value[start : start + micro_batch_size] for key, value in batch.items()}
        for start in range(0, num_rows, micro_batch_size)
    ]


def backward_micro_batches(
    micro_batches: Sequence[MicroBatch],
    loss_fn: LossFn,
    normalizer: LossNormalizer,
    mask_key: str = "response_mask",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Run forward + backward on each micro-batch, accumulating gradients for one optimizer step.

    Args:
        micro_batches: the mini-batch split in any way (e.g. by :func:`split_micro_batches`).
        loss_fn: ``(micro_batch, normalizer) -> (loss, metrics)``; ``loss`` must already be this micro-batch's
            contribution (built with ``aggregate_loss(..., normalizer)``). Its gradient is accumulated as is.
        normalizer: computed once over the whole mini-batch.
        mask_key: key of the ``[b, T]`` response mask in each micro-batch, used to weight metrics.

    Returns:
        ``(loss, metrics)``: the detached sum of the contributions (the mini-batch loss) and each metric averaged
        over micro-batches weighted by their valid-token counts, which turns per-micro-batch masked means (such
        as ``pg_clipfrac``) into exact mini-batch means. The caller steps the optimizer and zeroes gradients.
    """
    if not micro_batches:
        raise ValueError("micro_batches is empty; nothing to backpropagate")
    total: torch.Tensor | None = None
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for micro in micro_batches:
        if mask_key not in micro:
            raise ValueError(f"micro-batch has no {mask_key!r}; keys: {sorted(micro)}")
        loss, metrics = loss_fn(micro, normalizer)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
        num_tokens = float(micro[mask_key].to(torch.float64).sum().item())
        for name, value in metrics.items():
            scalar = float(value.item()) if isinstance(value, torch.Tensor) else float(value)
            sums[name] = sums.get(name, 0.0) + scalar * num_tokens
            weights[name] = weights.get(name, 0.0) + num_tokens
    averaged = {name: sums[name] / weights[name] if weights[name] > 0 else 0.0 for name in sums}
    assert total is not None
    return total, averaged
