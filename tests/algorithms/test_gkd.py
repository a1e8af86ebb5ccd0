"""GKD's generalized JSD against TRL's own ``GKDTrainer.generalized_jsd_loss`` (TRL 1.16.0, the benchmark extra:
``pip install "posttrain[bench]"``): the same loss and gradients to 1e-6 in fp32 over a grid of beta (both end
points included), temperature, masks and top-k, computed chunk by chunk from hidden states and head weights."""

import pytest
import torch

from posttrain.algorithms.gkd import chunked_generalized_jsd, generalized_jsd

gkd_trainer = pytest.importorskip(
    "trl.experimental.gkd.gkd_trainer", reason="TRL (posttrain[bench]) not installed"
)
trl_jsd = gkd_trainer.GKDTrainer.generalized_jsd_loss

N, H, HT, V = 23, 16, 24, 50


def _case(seed: int, masked: bool):
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(N, H, generator=g, dtype=torch.float64).float()
    w_s = (torch.randn(V, H, generator=g) * 0.5).float()
    b_s = torch.randn(V, generator=g) * 0.1
    h_t, w_t = torch.randn(N, HT, generator=g), torch.randn(V, HT, generator=g) * 0.5
    mask = torch.rand(N, generator=g) > 0.3 if masked else torch.ones(N, dtype=torch.bool)
    return h_s, w_s, b_s, h_t, w_t, mask


def _trl(h_s, w_s, b_s, h_t, w_t, mask, beta, temperature, top_k):
    """TRL's loss on full logits (for top-k: on the teacher's top-k columns of both, which is what renormalising
    over them means); returns the mean over masked tokens and the gradients of h_s, w_s, b_s."""
    h_s, w_s, b_s = (x.clone().requires_grad_() for x in (h_s, w_s, b_s))
    student = h_s @ w_s.T + b_s
    teacher = h_t @ w_t.T
    if top_k:
        index = (teacher / temperature).topk(top_k, dim=-1).indices
        student, teacher = student.gather(-1, index), teacher.gather(-1, index)
    labels = torch.where(mask, 1, -100).unsqueeze(0)
    loss = trl_jsd(
        student.unsqueeze(0), teacher.unsqueeze(0), labels=labels, beta=beta, temperature=temperature
    )
    loss.backward()
    return loss.detach(), (h_s.grad, w_s.grad, b_s.grad)


def _ours(h_s, w_s, b_s, h_t, w_t, mask, beta, temperature, top_k, chunk):
    h_s, w_s, b_s = (x.clone().requires_grad_() for x in (h_s, w_s, b_s))
    per_token = chunked_generalized_jsd(
        h_s,
        w_s,
        h_t,
        w_t,
        mask,
        beta=beta,
        temperature=temperature,
        top_k=top_k,
        chunk_size=chunk,
        student_bias=b_s,
    )
    assert not per_token[~mask].any()
    loss = per_token.sum() / mask.sum().clamp_min(1)
    loss.backward()
    return loss.detach(), (h_s.grad, w_s.grad, b_s.grad)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("masked", [False, True])
def test_loss_and_gradients_equal_trls(beta, temperature, top_k, masked):
    case = _case(int(beta * 10) + int(temperature * 10) + top_k, masked)
    expected, expected_grads = _trl(*case, beta, temperature, top_k)
    for chunk in (4, N):  # several chunks (the last one short) and one
        loss, grads = _ours(*case, beta, temperature, top_k, chunk)
        torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
        for ours, theirs in zip(grads, expected_grads):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert float(expected) > 0


def test_end_points_are_the_two_kls_and_equal_distributions_give_zero():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(7, V, generator=g), torch.randn(7, V, generator=g)
    log_s, log_t = s.log_softmax(-1), t.log_softmax(-1)
    forward = (log_t.exp() * (log_t - log_s)).sum(-1)
    reverse = (log_s.exp() * (log_s - log_t)).sum(-1)
    torch.testing.assert_close(generalized_jsd(s, t, beta=0.0), forward)
    torch.testing.assert_close(generalized_jsd(s, t, beta=1.0), reverse)
    assert float(generalized_jsd(s, s, beta=0.5).abs().max()) < 1e-6
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(s, t, beta=1.5)
