"""The Bradley-Terry loss by hand, the score at the last real token, and gradients that do not depend on the
micro-batch size, the padding side, a token budget or packing."""

import math

import pytest
import torch

from posttrain.algorithms.aggregation import LossNormalizer
from posttrain.models.hf import load_tokenizer
from posttrain.rm.data import TokenizedPair, encode, render
from posttrain.rm.loop import rm_step
from posttrain.rm.loss import bradley_terry, pair_batch, pair_micro_rows, pair_token_micro_rows, rm_loss_fn
from posttrain.rm.model import load_reward_model, pad_right, sequence_scores
from posttrain.train.trainable import Trainable


def test_loss_and_accuracy_match_a_hand_computation():
    chosen = torch.tensor([1.0, 0.0, 2.0, -1.0])
    rejected = torch.tensor([0.5, 0.5, -1.0, -0.5])
    margin = torch.tensor([0.0, 0.2, 1.0, 0.0])
    loss, m = bradley_terry(chosen, rejected, margin, num_pairs=4)

    def nls(x):  # -log sigmoid(x)
        return math.log(1 + math.exp(-x))

    expected = (nls(0.5) + nls(-0.7) + nls(2.0) + nls(-0.5)) / 4
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert float(m["accuracy"]) == pytest.approx(0.5)  # pairs 0 and 2
    assert float(m["margin"]) == pytest.approx((0.5 - 0.5 + 3.0 - 0.5) / 4)
    centered, _ = bradley_terry(chosen, rejected, margin, num_pairs=4, center_coef=0.01)
    squares = (1.5**2 + 0.5**2 + 1.0**2 + 1.5**2) / 4
    assert float(centered) == pytest.approx(expected + 0.01 * squares, rel=1e-6)


def test_shares_add_up_to_the_whole_batch_loss():
    c, r, m = torch.randn(6), torch.randn(6), torch.rand(6)
    whole, _ = bradley_terry(c, r, m, 6, 0.1)
    parts = sum(float(bradley_terry(c[i : i + 2], r[i : i + 2], m[i : i + 2], 6, 0.1)[0]) for i in (0, 2, 4))
    assert parts == pytest.approx(float(whole), rel=1e-6)


@pytest.fixture(scope="module")
def model_and_pairs(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    model = load_reward_model(tiny_model_dir, tok.pad_token_id)
    problems = [(3, 4), (12, 9), (40, 2), (7, 77), (5, 5), (61, 30)]
    pairs = [
        TokenizedPair(
            encode(tok, render(tok, f"What is {a} + {b}?", str(a + b))),
            encode(tok, render(tok, f"What is {a} + {b}?", str(a + b + 1 + i * 11))),
            0.1 * i,
        )
        for i, (a, b) in enumerate(problems)
    ]
    return model, pairs, tok.pad_token_id


def test_score_is_read_at_the_last_real_token_whatever_the_padding(model_and_pairs):
    model, pairs, pad = model_and_pairs
    model.eval()
    seqs = [p.chosen_ids for p in pairs] + [p.rejected_ids[:5] for p in pairs]
    with torch.no_grad():
        alone = torch.stack(
            [
                sequence_scores(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0]
                for s in seqs
            ]
        )
        ids, mask = pad_right(seqs, pad)
        right = sequence_scores(model, ids, mask)
        batch, _ = pair_batch([TokenizedPair(s, s, 0.0) for s in seqs], pad)  # left-padded layout
        left = sequence_scores(model, batch.input_ids, batch.attention_mask)[: len(seqs)]
    torch.testing.assert_close(right, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(left, alone, atol=1e-5, rtol=1e-5)


def _grads(model, pairs, pad, pairs_per_micro, center=0.05, max_tokens=0, packed_row_tokens=0):
    model.zero_grad(set_to_none=True)
    mini, margins = pair_batch(pairs, pad)
    normalizer = LossNormalizer.from_mask(mini.response_mask, norm_constant=1.0)
    loss_fn = rm_loss_fn(model, margins, center, packed_row_tokens)
    total = 0.0
    if max_tokens:
        micro_rows = pair_token_micro_rows(pairs, max_tokens)
    else:
        micro_rows = pair_micro_rows(len(pairs), pairs_per_micro)
    for rows in micro_rows:
        loss, _ = loss_fn(mini.select(rows).trimmed(), normalizer)
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return total, grads


def _right_padded_grads(model, pairs, pad, center=0.05):
    """The same loss computed on right-padded rows, in one pass."""
    model.zero_grad(set_to_none=True)
    ids, mask = pad_right([p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs], pad)
    scores = sequence_scores(model, ids, mask)
    n = len(pairs)
    margin = torch.tensor([p.margin for p in pairs])
    loss, _ = bradley_terry(scores[:n], scores[n:], margin, n, center)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def test_gradients_do_not_depend_on_micro_batches_padding_token_budget_or_packing(model_and_pairs):
    model, pairs, pad = model_and_pairs
    model.train()
    loss_ref, ref = _grads(model, pairs, pad, len(pairs))
    runs = [_grads(model, pairs, pad, k) for k in (1, 2, 4)] + [_right_padded_grads(model, pairs, pad)]
    longest = max(len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
    runs += [_grads(model, pairs, pad, 0, max_tokens=t) for t in (longest, 2 * longest + 5)]  # dynamic batch
    # packed (model.use_remove_padding): rows of 64 tokens hold two or three texts; one row per text; one row
    runs += [_grads(model, pairs, pad, k, packed_row_tokens=r) for k, r in ((6, 64), (2, 1), (3, 4096))]
    runs += [_grads(model, pairs, pad, 0, max_tokens=longest, packed_row_tokens=64)]  # packed and dynamic
    scale = max(float(g.abs().max()) for g in ref.values())
    for loss, grads in runs:
        assert loss == pytest.approx(loss_ref, rel=1e-5)
        assert grads.keys() == ref.keys()
        for name in ref:
            torch.testing.assert_close(grads[name], ref[name], atol=1e-5 * scale, rtol=1e-4)


def test_a_step_reports_the_whole_batch_metrics(model_and_pairs, tiny_model_dir):
    _, pairs, pad = model_and_pairs
    torch.manual_seed(0)
    model = load_reward_model(tiny_model_dir, pad)
    from posttrain.config.schema import OptimConfig

    trainable = Trainable.create(model, OptimConfig(lr=1e-3), 10)
    with torch.no_grad():
        model.eval()
        ids, mask = pad_right([p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs], pad)
        s = sequence_scores(model, ids, mask)
        model.train()
    expected, m = bradley_terry(s[:6], s[6:], torch.tensor([p.margin for p in pairs]), 6)
    metrics = rm_step(trainable, pairs, pad, pairs_per_micro=4)
    assert metrics["rm/loss"] == pytest.approx(float(expected), rel=1e-4)
    assert metrics["rm/accuracy"] == pytest.approx(float(m["accuracy"]))
    assert metrics["rm/margin"] == pytest.approx(float(m["margin"]), rel=1e-4, abs=1e-6)


def test_token_budget_micro_batches_hold_whole_pairs_within_the_budget(model_and_pairs):
    _, pairs, _ = model_and_pairs
    n = len(pairs)
    sizes = [len(p.chosen_ids) + len(p.rejected_ids) for p in pairs]
    budget = 2 * max(sizes)
    micro = pair_token_micro_rows(pairs, budget)
    assert 1 < len(micro) < n
    seen = []
    for rows in micro:
        chosen, rejected = rows[: len(rows) // 2], rows[len(rows) // 2 :]
        assert rejected == [n + i for i in chosen]  # both sides of each pair, in the loss's layout
        assert sum(sizes[i] for i in chosen) <= budget
        seen += chosen
    assert sorted(seen) == list(range(n))
