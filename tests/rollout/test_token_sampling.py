"""Keyed sampling noise: a pure function of (seed, sample id, step, token), uniform, and exact sampling."""

import pytest
import torch

from posttrain.rollout.native.token_sampling import (
    exponential_noise,
    filter_top_k_top_p,
    mix64,
    row_keys,
    sample_tokens,
    uniform_noise,
)


def _splitmix64_reference(x: int) -> int:
    mask = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_mix64_is_splitmix64_in_int64():
    xs = [0, 1, 12345, 2**40 + 7, 2**63 - 1, -1, -(2**63)]
    got = mix64(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [_splitmix64_reference(x & ((1 << 64) - 1)) for x in xs]


def test_uniforms_are_uniform_and_in_open_interval():
    u = uniform_noise(row_keys(3, torch.arange(200), torch.zeros(200, dtype=torch.long)), 500)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.003 and abs(u.var().item() - 1 / 12) < 0.002
    # Neighbouring keys (consecutive samples, steps, tokens) are uncorrelated.
    assert abs(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]) < 0.01
    assert abs(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]) < 0.01


def test_noise_of_a_row_does_not_depend_on_the_other_rows():
    ids, steps = torch.tensor([4, 9, 2, 7]), torch.tensor([0, 3, 1, 5])
    together = exponential_noise(11, ids, steps, 64)
    for i in range(4):
        alone = exponential_noise(11, ids[i : i + 1], steps[i : i + 1], 64)
        assert torch.equal(alone[0], together[i])
    assert not torch.equal(exponential_noise(12, ids, steps, 64), together)  # the seed matters
    assert not torch.equal(exponential_noise(11, ids, steps + 1, 64), together)  # so does the step


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.0, 5, 1.0), (1.3, -1, 0.6), (1.0, 8, 0.8)],
)
def test_samples_follow_the_filtered_softmax(temperature, top_k, top_p, chi_square):
    logits = torch.randn(40, generator=torch.Generator().manual_seed(0)) * 2
    rows = 60_000
    tokens, logprobs = sample_tokens(
        logits.expand(rows, -1),
        greedy=False,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=5,
        sample_ids=torch.arange(rows),
        steps=torch.zeros(rows, dtype=torch.long),
    )
    filtered = filter_top_k_top_p((logits / temperature)[None], top_k, top_p)[0]
    probs = filtered.softmax(-1)
    counts = torch.bincount(tokens, minlength=40)
    assert counts[probs == 0].sum() == 0  # never outside the top-k / top-p support
    stat, critical = chi_square(counts, probs)
    assert stat < critical, (stat, critical)
    # Log-probs are those of the unfiltered temperature-scaled distribution.
    torch.testing.assert_close(logprobs, torch.log_softmax(logits / temperature, -1)[tokens])


def test_greedy_is_argmax_with_temperature_one_logprobs():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 3.0, 0.0]])
    tokens, logprobs = sample_tokens(
        logits,
        greedy=True,
        temperature=0.3,
        top_k=-1,
        top_p=1.0,
        seed=0,
        sample_ids=torch.arange(2),
        steps=torch.zeros(2, dtype=torch.long),
    )
    assert tokens.tolist() == [1, 0]  # first index on ties
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[torch.arange(2), tokens])


def test_filter_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))

    def kept(top_k, top_p):
        return torch.isfinite(filter_top_k_top_p(logits, top_k=top_k, top_p=top_p))[0].tolist()

    assert kept(2, 1.0) == [True, True, False, False]
    assert kept(-1, 0.8) == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert kept(-1, 0.81) == [True, True, True, False]
    assert kept(-1, 0.1) == [True, False, False, False]  # the most likely token always survives
    assert kept(3, 0.6) == [True, True, False, False]
