"""Token log-probs and entropies from logits against numpy references."""

import numpy as np
import pytest
import torch

from posttrain.algorithms.logprobs import (
    entropy_from_logits,
    logprobs_and_entropy,
    logprobs_from_logits,
)

pytestmark = pytest.mark.numerics  # runs again under other CPU instruction sets in CI


def np_log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def logits(n=7, v=13, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g, dtype=torch.float64) * 3).to(dtype)


def test_logprobs_match_numpy():
    z = logits()
    labels = torch.tensor([0, 12, 3, 3, 7, 1, 5])
    got = logprobs_from_logits(z, labels)
    expected = np_log_softmax(z.numpy())[np.arange(7), labels.numpy()]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)
    assert got.dtype == torch.float64


def test_logprobs_batched_shape_and_fp32_math_for_bf16():
    z = logits(12, 9, seed=1).reshape(3, 4, 9)
    labels = torch.randint(0, 9, (3, 4), generator=torch.Generator().manual_seed(0))
    got = logprobs_from_logits(z.to(torch.bfloat16), labels)
    assert got.shape == (3, 4) and got.dtype == torch.float32
    expected = np.take_along_axis(
        np_log_softmax(z.to(torch.bfloat16).double().numpy()), labels.numpy()[..., None], -1
    )
    np.testing.assert_allclose(got.numpy(), expected[..., 0], rtol=1e-5, atol=1e-5)


def test_logprobs_gradient_is_onehot_minus_softmax():
    z = logits(3, 5).requires_grad_(True)
    labels = torch.tensor([4, 0, 2])
    logprobs_from_logits(z, labels).sum().backward()
    p = np.exp(np_log_softmax(z.detach().numpy()))
    np.testing.assert_allclose(z.grad.numpy(), np.eye(5)[labels.numpy()] - p, atol=1e-12)


def test_logprobs_shape_mismatch():
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_from_logits(logits(), torch.zeros(6, dtype=torch.long))


def test_entropy_matches_numpy():
    z = logits(seed=2)
    logp = np_log_softmax(z.numpy())
    expected = -(np.exp(logp) * logp).sum(-1)
    np.testing.assert_allclose(entropy_from_logits(z).numpy(), expected, rtol=1e-12)
    uniform = torch.zeros(2, 8)
    np.testing.assert_allclose(entropy_from_logits(uniform).numpy(), np.log(8), rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_logprobs_and_entropy_together_equal_each_alone_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 37, generator=g) * 4).to(dtype)
    labels = torch.randint(0, 37, (3, 5), generator=g)
    logp, entropy = logprobs_and_entropy(logits, labels)
    assert torch.equal(logp, logprobs_from_logits(logits, labels))
    assert torch.equal(entropy, entropy_from_logits(logits))
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_and_entropy(logits, labels[:, :2])
