"""Shared helpers of the rollout tests."""

import math

import pytest
import torch


def _chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, float]:
    """Pearson's statistic of ``counts`` against ``probs`` (cells expecting < 5 pooled into one) and its
    critical value at p ~ 3e-5 (Wilson-Hilferty approximation of the chi-square quantile at z = 4)."""
    expected = probs.double() * counts.sum().item()
    big = expected >= min_expected
    obs = torch.cat([counts[big].double(), counts[~big].sum().double()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum().item()
    dof = int(keep.sum().item()) - 1
    critical = dof * (1 - 2 / (9 * dof) + 4.0 * math.sqrt(2 / (9 * dof))) ** 3
    return stat, critical


@pytest.fixture
def chi_square():
    """``chi_square(counts, probs) -> (statistic, critical value)``: sampled counts vs probabilities."""
    return _chi_square
