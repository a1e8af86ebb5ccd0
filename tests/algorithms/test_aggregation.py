"""Loss aggregation (global denominators) and masked reductions, against numpy references."""

import numpy as np
import pytest
import torch

from posttrain.algorithms.aggregation import LOSS_AGG_MODES, LossNormalizer, aggregate_loss
from posttrain.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten

pytestmark = pytest.mark.numerics  # runs again under other CPU instruction sets in CI

T = 5
# right-padded, full, single valid token, fully masked, left-padded, gap in the middle (observation span)
MASK = np.array(
    [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0],
        [0, 0, 1, 1, 1],
        [1, 1, 0, 0, 1],
    ],
    dtype=np.float64,
)


def loss_matrix(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=MASK.shape)


def reference_agg(loss: np.ndarray, mask: np.ndarray, mode: str, horizon: float) -> float:
    """verl's agg_loss on one piece, written with plain loops."""
    rows = [r for r in range(loss.shape[0]) if mask[r].sum() > 0]
    if mode == "token-mean":
        num = sum(loss[r, t] for r in range(loss.shape[0]) for t in range(loss.shape[1]) if mask[r, t])
        return num / mask.sum()
    seq = []
    for r in rows:
        s = sum(loss[r, t] for t in range(loss.shape[1]) if mask[r, t])
        seq.append(s / mask[r].sum() if mode == "seq-mean-token-mean" else s)
    value = sum(seq) / len(rows)
    return value / horizon if mode == "seq-mean-token-sum-norm" else value


def split_rows(n: int, sizes: list[int]) -> list[slice]:
    out, start = [], 0
    for size in sizes:
        out.append(slice(start, start + size))
        start += size
    assert start == n
    return out


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_whole_batch_matches_reference(mode):
    loss, mask = loss_matrix(), MASK
    norm = LossNormalizer.from_mask(torch.tensor(mask), norm_constant=T)
    got = aggregate_loss(torch.tensor(loss), torch.tensor(mask), mode, norm)
    assert got.item() == pytest.approx(reference_agg(loss, mask, mode, T), rel=1e-7)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("sizes", [[1] * 6, [2, 2, 2], [4, 2], [3, 1, 2], [1, 5], [6]])
def test_contributions_sum_to_whole(mode, sizes):
    loss, mask = torch.tensor(loss_matrix(1)), torch.tensor(MASK)
    norm = LossNormalizer.from_mask(mask, norm_constant=T)
    whole = aggregate_loss(loss, mask, mode, norm)
    parts = [aggregate_loss(loss[s], mask[s], mode, norm) for s in split_rows(6, sizes)]
    torch.testing.assert_close(sum(parts), whole, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_fully_masked_row_contributes_zero_even_with_nan(mode):
    loss = torch.tensor(loss_matrix(2))
    loss[3] = float("nan")  # fully masked row
    loss[0, 4] = float("inf")  # masked position
    mask = torch.tensor(MASK)
    norm = LossNormalizer.from_mask(mask, norm_constant=T)
    assert aggregate_loss(loss[3:4], mask[3:4], mode, norm).item() == 0.0
    whole = aggregate_loss(loss, mask, mode, norm)
    assert torch.isfinite(whole)
    clean = torch.tensor(loss_matrix(2))
    assert whole.item() == pytest.approx(reference_agg(clean.numpy(), MASK, mode, T), rel=1e-7)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_masked_mini_batch_gives_zero_loss_and_grad(mode):
    loss = torch.randn(3, T, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(3, T)
    norm = LossNormalizer.from_mask(mask, norm_constant=T)
    out = aggregate_loss(loss, mask, mode, norm)
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(loss.grad, torch.zeros_like(loss))


def test_normalizer_counts_and_bool_mask():
    norm = LossNormalizer.from_mask(torch.tensor(MASK).bool(), norm_constant=8)
    assert norm.num_tokens == MASK.sum() == 15
    assert norm.num_sequences == 5  # the fully masked row does not count
    assert norm.norm_constant == 8.0 and norm.dp_size == 1


def test_norm_constant_is_the_horizon_not_the_padded_width():
    loss, mask = torch.tensor(loss_matrix(3)), torch.tensor(MASK)
    norm = LossNormalizer.from_mask(mask, norm_constant=16)
    padded = torch.nn.functional.pad(loss, (0, 3))  # wider padding must not change the loss
    padded_mask = torch.nn.functional.pad(mask, (0, 3))
    a = aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm)
    b = aggregate_loss(padded, padded_mask, "seq-mean-token-sum-norm", norm)
    torch.testing.assert_close(a, b)
    assert a.item() == pytest.approx(reference_agg(loss.numpy(), MASK, "seq-mean-token-sum-norm", 16))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_dp_ranks_averaged_equal_whole(mode):
    """Two ranks with global counts and dp_size=2, averaged as DDP does, equal the single-process loss."""
    loss, mask = torch.tensor(loss_matrix(4)), torch.tensor(MASK)
    whole = aggregate_loss(loss, mask, mode, LossNormalizer.from_mask(mask, T))
    local = [LossNormalizer.from_mask(mask[s], T) for s in (slice(0, 2), slice(2, 6))]
    glob = LossNormalizer(
        num_tokens=sum(n.num_tokens for n in local),
        num_sequences=sum(n.num_sequences for n in local),
        norm_constant=T,
        dp_size=2,
    )
    ranks = [aggregate_loss(loss[s], mask[s], mode, glob) for s in (slice(0, 2), slice(2, 6))]
    torch.testing.assert_close((ranks[0] + ranks[1]) / 2, whole, rtol=0, atol=1e-12)


def test_unknown_mode_error_lists_valid_modes():
    norm = LossNormalizer.from_mask(torch.ones(1, 2), 2)
    with pytest.raises(ValueError, match=r"'seq-sum'.*token-mean.*seq-mean-token-sum-norm"):
        aggregate_loss(torch.ones(1, 2), torch.ones(1, 2), "seq-sum", norm)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_tokens=-1, num_sequences=1, norm_constant=1),
        dict(num_tokens=1, num_sequences=1, norm_constant=0),
        dict(num_tokens=1, num_sequences=-2, norm_constant=1),
        dict(num_tokens=1, num_sequences=1, norm_constant=1, dp_size=0),
    ],
)
def test_normalizer_validation(kwargs):
    with pytest.raises(ValueError):
        LossNormalizer(**kwargs)


# ----- masked reductions -----------------------------------------------------------------------------------


def test_masked_sum_mean_ignore_values_outside_mask():
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert masked_sum(values, mask).item() == 13.0
    assert masked_mean(values, mask).item() == pytest.approx(13.0 / 4)
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 5.0]))
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_masked_var_and_whiten_match_numpy():
    rng = np.random.default_rng(5)
    values = rng.normal(size=MASK.shape) * 3 + 1
    sel = values[MASK.astype(bool)]
    var = masked_var(torch.tensor(values), torch.tensor(MASK))
    assert var.item() == pytest.approx(np.var(sel, ddof=1), rel=1e-7)
    assert masked_var(torch.tensor(values), torch.tensor(MASK), unbiased=False).item() == pytest.approx(
        np.var(sel), rel=1e-7
    )
    white = masked_whiten(torch.tensor(values), torch.tensor(MASK)).numpy()
    expected = (values - sel.mean()) / np.sqrt(np.var(sel, ddof=1) + 1e-8)
    np.testing.assert_allclose(white, expected, rtol=1e-6)
    kept = masked_whiten(torch.tensor(values), torch.tensor(MASK), shift_mean=False).numpy()
    np.testing.assert_allclose(kept, expected + sel.mean(), rtol=1e-6)


def test_masked_var_needs_two_elements():
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(torch.ones(1, 3), torch.tensor([[0, 1, 0]]))


def test_float_mask_weights_tokens_as_verl():
    loss = torch.tensor([[2.0, 4.0, 9.0], [8.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[0.5, 0.25, 0.0], [0.25, 0.0, 0.0]], dtype=torch.float64)
    norm = LossNormalizer.from_mask(mask, norm_constant=3)
    assert norm.num_tokens == 1.0 and norm.num_sequences == 2
    assert aggregate_loss(loss, mask, "token-mean", norm).item() == pytest.approx((1.0 + 1.0 + 2.0) / 1.0)
    seq_mean = aggregate_loss(loss, mask, "seq-mean-token-mean", norm).item()
    assert seq_mean == pytest.approx((2.0 / 0.75 + 2.0 / 0.25) / 2, rel=1e-6)
