"""Masked reductions over padded ``[B, T]`` tensors.

A mask is a bool or float tensor broadcastable to the values; non-zero entries select elements (a float mask
also weights them, as in verl). Values outside the mask never leak into a result, even when they are NaN or inf.

Semantics match verl's ``torch_functional`` helpers: ``masked_mean`` divides by ``mask.sum() + 1e-8`` (so an
empty mask gives 0, not NaN), ``masked_var`` applies Bessel's correction by default, and ``masked_whiten``
scales by ``rsqrt(var + 1e-8)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

BatchSum = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor of partial sums over the whole batch when the batch is spread over data-parallel ranks (each
holding a share): the one thing a batch statistic needs from the other ranks. None: the batch is all here."""

MEAN_EPS = 1e-8
"""Added to the mask count in :func:`masked_mean` (verl's value)."""

WHITEN_EPS = 1e-8
"""Added to the variance in :func:`masked_whiten` (verl's value)."""


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is non-zero.

    Args:
        values: ``[...]`` float tensor.
        mask: bool or float tensor broadcastable to ``values``.
        dim: dimension to reduce; ``None`` reduces everything to a scalar.

    Returns:
        The masked sum, ``values`` reduced over ``dim``.
    """
    selected = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    weighted = selected * mask.to(values.dtype)
    return weighted.sum() if dim is None else weighted.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the mask: ``masked_sum / (mask.sum() + 1e-8)``; 0 for an empty mask.

    Args:
        values: ``[...]`` float tensor.
        mask: bool or float tensor broadcastable to ``values``.
        dim: dimension to reduce; ``None`` reduces everything to a scalar.
    """
    count = mask.to(values.dtype)
    count = count.sum() if dim is None else count.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + MEAN_EPS)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over all masked elements (a scalar).

    Args:
        values: ``[...]`` float tensor.
        mask: bool or float tensor broadcastable to ``values``.
        unbiased: apply Bessel's correction ``n / (n - 1)`` with ``n = mask.sum()`` (verl's default).

    Raises:
        ValueError: if ``unbiased`` and the mask selects fewer than two elements (the correction is undefined).
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = float(mask.to(values.dtype).sum().item())
        if n <= 1:
            raise ValueError(
                f"masked_var(unbiased=True) needs at least 2 masked elements, got mask.sum()={n:g}; "
                "use a larger batch or unbiased=False"
            )
        var = var * (n / (n - 1))
    return var


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, batch_sum: BatchSum | None = None
) -> torch.Tensor:
    """Normalise ``values`` to zero mean and unit variance using statistics over the mask.

    ``(values - mean) * rsqrt(var + 1e-8)`` with the unbiased masked variance. Like verl, the transform is
    applied to every element (also outside the mask); callers multiply by the mask where that matters.

    Args:
        values: ``[B, T]`` float tensor.
        mask: bool or float tensor broadcastable to ``values``.
        shift_mean: when False the original mean is added back after scaling.
        batch_sum: when ``values`` is one rank's share of the batch, the statistics are the whole batch's
            (two sums over ranks: the masked sum and count, then the squared deviations).

    Returns:
        ``[B, T]`` whitened values.

    Raises:
        ValueError: if the mask selects fewer than two elements.
    """
    if batch_sum is None:
        mean = masked_mean(values, mask)
        var = masked_var(values, mask, unbiased=True)
    else:
        mean, var = _batch_mean_var(values, mask, batch_sum)
    whitened = (values - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def _batch_mean_var(
    values: torch.Tensor, mask: torch.Tensor, batch_sum: BatchSum
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`masked_mean` and unbiased :func:`masked_var` over a batch spread over ranks."""
    count_local = mask.to(values.dtype).sum()
    total, count = batch_sum(torch.stack([masked_sum(values, mask), count_local]))
    mean = total / (count + MEAN_EPS)
    var = batch_sum(masked_sum((values - mean) ** 2, mask).reshape(1))[0] / (count + MEAN_EPS)
    n = float(count.item())
    if n <= 1:
        raise ValueError(
            f"masked_var(unbiased=True) needs at least 2 masked elements, got mask.sum()={n:g}; "
            "use a larger batch or unbiased=False"
        )
    return mean, var * (n / (n - 1))
