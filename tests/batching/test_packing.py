"""Packing: exact round trip, whole sequences per row, restarting positions, overhead accounting."""

import random

import pytest
import torch

from posttrain.batching.packing import compute_tokens, pack_sequences, plan_rows, unpack, unpack_to_padded

pytestmark = pytest.mark.numerics  # runs again under other CPU instruction sets in CI


def _seqs(lengths, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g) for n in lengths]


LENGTHS = [7, 3, 12, 1, 5, 9, 16, 2]


@pytest.mark.parametrize("max_row_tokens", [None, 16, 20, 40])
def test_round_trip_and_layout(max_row_tokens):
    seqs = _seqs(LENGTHS)
    packed = pack_sequences(seqs, max_row_tokens, pad_token_id=0)
    R, L = packed.input_ids.shape
    assert packed.position_ids.shape == (R, L)
    # exact round trip, original order
    for orig, back in zip(seqs, packed.unpack(packed.input_ids)):
        assert torch.equal(orig, back)
    assert all(
        torch.equal(a, b)
        for a, b in zip(unpack(packed, packed.position_ids), [torch.arange(n) for n in LENGTHS])
    )
    # rows bounded, rectangular only up to the longest row, pads only at row ends
    if max_row_tokens is not None:
        assert max(packed.row_lengths) <= max_row_tokens
    assert max(packed.row_lengths) == L
    valid = packed.valid_mask()
    for r in range(R):
        n = packed.row_lengths[r]
        assert valid[r, :n].all() and not valid[r, n:].any()
        assert (packed.input_ids[r, n:] == 0).all()
        # the pad tail is its own segment with positions restarting at 0
        assert torch.equal(packed.position_ids[r, n:], torch.arange(L - n))
    assert int(valid.sum()) == sum(LENGTHS)


def test_no_sequence_split_across_rows_and_positions_restart():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 30))]
        packed = pack_sequences(_seqs(lengths, seed=1), 96)
        seen = torch.zeros_like(packed.input_ids, dtype=torch.bool)
        for i, n in enumerate(lengths):
            r, s = packed.seq_rows[i], packed.seq_starts[i]
            assert s + n <= packed.row_lengths[r]  # contiguous span inside one row
            assert torch.equal(packed.position_ids[r, s : s + n], torch.arange(n))
            assert not seen[r, s : s + n].any()
            seen[r, s : s + n] = True
        assert torch.equal(seen, packed.valid_mask())


def test_unpack_to_padded_right_and_left():
    seqs = _seqs(LENGTHS)
    packed = pack_sequences(seqs, 20)
    right = packed.unpack_to_padded(packed.input_ids, pad_value=-1)
    left = unpack_to_padded(packed, packed.input_ids, pad_value=-1, side="left", length=18)
    assert right.shape == (len(seqs), max(LENGTHS))
    assert left.shape == (len(seqs), 18)
    for i, s in enumerate(seqs):
        n = len(s)
        assert torch.equal(right[i, :n], s) and (right[i, n:] == -1).all()
        assert torch.equal(left[i, 18 - n :], s) and (left[i, : 18 - n] == -1).all()
    with pytest.raises(ValueError, match="shorter"):
        packed.unpack_to_padded(packed.input_ids, length=3)


def test_per_token_tensors_with_trailing_dims_and_gradients():
    packed = pack_sequences(_seqs(LENGTHS), 24)
    x = torch.randn(packed.num_rows, packed.row_len, 3, requires_grad=True)
    parts = packed.unpack(x)
    assert [p.shape for p in parts] == [(n, 3) for n in LENGTHS]
    sum(p.sum() for p in parts).backward()
    assert torch.equal(x.grad[..., 0], packed.valid_mask().float())  # gradient only on real tokens


def test_pack_values_and_next_token_labels():
    seqs = _seqs(LENGTHS)
    packed = pack_sequences(seqs, 20)
    masks = [torch.arange(n, dtype=torch.float32) for n in LENGTHS]
    laid_out = packed.pack_values(masks, pad_value=-5.0)
    assert all(torch.equal(a, b) for a, b in zip(packed.unpack(laid_out), masks))
    assert (laid_out[~packed.valid_mask()] == -5.0).all()
    labels = packed.unpack(packed.next_token_labels(ignore_index=-100))
    for s, lab in zip(seqs, labels):
        assert torch.equal(lab[:-1], s[1:]) and lab[-1] == -100  # never the next sequence's first token


def test_overhead_accounting():
    rng = random.Random(0)
    lengths = [rng.randint(50, 300) + min(1024, int(rng.lognormvariate(5.5, 1.0))) for _ in range(64)]
    padded = compute_tokens(lengths, layout="padded")
    one_row = compute_tokens(lengths, layout="packed")
    bounded = compute_tokens(lengths, layout="packed", max_row_tokens=4096)
    assert padded.computed_tokens == len(lengths) * max(lengths)
    assert one_row.overhead == 1.0 and one_row.rows == 1
    assert 1.0 <= bounded.overhead <= 1.05 < padded.overhead
    assert bounded.attention_cells < one_row.attention_cells  # why rows are bounded on CPU
    packed = pack_sequences([torch.ones(n, dtype=torch.long) for n in lengths], 4096)
    assert packed.input_ids.numel() == bounded.computed_tokens


def test_errors():
    with pytest.raises(ValueError, match="max_row_tokens=8"):
        pack_sequences(_seqs([3, 9]), 8)
    with pytest.raises(ValueError, match="empty"):
        plan_rows([3, 0], 8)
    with pytest.raises(ValueError, match="1-D"):
        pack_sequences([torch.ones(2, 2, dtype=torch.long)])
    packed = pack_sequences(_seqs([3, 4]), 8)
    with pytest.raises(ValueError, match="packed layout"):
        packed.unpack(torch.zeros(5, 5))
