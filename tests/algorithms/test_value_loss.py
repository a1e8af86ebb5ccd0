"""Clipped value loss against a per-token reference."""

import numpy as np
import pytest
import torch

from posttrain.algorithms.aggregation import LOSS_AGG_MODES, LossNormalizer, aggregate_loss
from posttrain.algorithms.value_loss import compute_value_loss

MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 1, 1, 1]], dtype=torch.float64)
CLIP = 0.2


def run(vpreds, returns, values, mask=MASK, mode="token-mean", clip=CLIP):
    norm = LossNormalizer.from_mask(mask, norm_constant=mask.shape[1])
    return compute_value_loss(
        vpreds=vpreds,
        returns=returns,
        values=values,
        response_mask=mask,
        cliprange_value=clip,
        normalizer=norm,
        loss_agg_mode=mode,
    )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_matches_reference(mode):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(MASK.shape, generator=g, dtype=torch.float64)
    vpreds = (values + torch.randn(MASK.shape, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True)
    returns = torch.randn(MASK.shape, generator=g, dtype=torch.float64)
    loss, metrics = run(vpreds, returns, values, mode=mode)
    mat = np.zeros(MASK.shape)
    clipped_count = 0
    for i in range(MASK.shape[0]):
        for t in range(MASK.shape[1]):
            v, r, old = vpreds[i, t].item(), returns[i, t].item(), values[i, t].item()
            vc = min(max(v, old - CLIP), old + CLIP)
            mat[i, t] = max((v - r) ** 2, (vc - r) ** 2)
            clipped_count += bool(MASK[i, t]) and (vc - r) ** 2 > (v - r) ** 2
    norm = LossNormalizer.from_mask(MASK, MASK.shape[1])
    expected = 0.5 * aggregate_loss(torch.tensor(mat), MASK, mode, norm).item()
    assert loss.item() == pytest.approx(expected, rel=1e-10)
    assert metrics["vf_clipfrac"].item() == pytest.approx(clipped_count / MASK.sum().item())
    assert 0 < clipped_count < MASK.sum().item()  # the data exercises both branches


def test_hand_computed_single_token():
    one = torch.ones(1, 1)
    # vpred 1.0 moved from old value 0.0; clip 0.2 -> 0.2. return 0.0: unclipped error 1.0 > clipped 0.04
    vpred = torch.tensor([[1.0]], requires_grad=True)
    loss, m = run(vpred, torch.zeros(1, 1), torch.zeros(1, 1), mask=one)
    loss.backward()
    assert loss.item() == pytest.approx(0.5) and vpred.grad.item() == pytest.approx(1.0)
    assert m["vf_clipfrac"].item() == 0.0
    # return 2.0: clipped error (0.2 - 2)^2 = 3.24 > (1 - 2)^2 = 1 -> clipped branch, no gradient
    vpred = torch.tensor([[1.0]], requires_grad=True)
    loss, m = run(vpred, torch.full((1, 1), 2.0), torch.zeros(1, 1), mask=one)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * 3.24) and vpred.grad.item() == 0.0
    assert m["vf_clipfrac"].item() == pytest.approx(1.0)


def test_validation():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="cliprange_value"):
        run(x, x, x, mask=torch.ones(2, 3), clip=-1.0)
    with pytest.raises(ValueError, match="shapes"):
        run(x, torch.zeros(2, 2), x, mask=torch.ones(2, 3))
