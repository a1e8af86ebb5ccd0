"""Chunked (and checkpointed) log-probs/entropy equal the full-logits computation, values and gradients."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.batching.packing import pack_sequences
from posttrain.forward.chunked_head import chunked_logprobs_entropy, naive_logprobs_entropy
from posttrain.forward.packed import lm_head_parameters, packed_causal_lm_forward
from tests.helpers import tiny_qwen2_config

pytestmark = pytest.mark.numerics  # runs again under other CPU instruction sets in CI

N, H, V = 37, 16, 53  # N not a multiple of the chunk size


def _inputs(dtype, with_bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, H, generator=g, dtype=torch.float64) * 2).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if with_bias else None
    labels = torch.randint(0, V, (N,), generator=g)
    labels[[3, 20]] = -100  # ignored positions
    coeff = torch.randn(2, N, generator=g, dtype=torch.float64) / N  # a mean-style loss
    return hidden, weight, bias, labels, coeff


def _run(fn, hidden, weight, bias, labels, coeff, **kw):
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    logp, ent = fn(hidden, weight, labels, bias=bias, **kw)
    (coeff[0].to(logp.dtype) * logp + coeff[1].to(ent.dtype) * ent).sum().backward()
    grads = [t.grad.clone() for t in (hidden, weight, bias) if t is not None]
    return logp.detach(), ent.detach(), grads


MODES = {
    "fused-recompute": dict(checkpoint=True, fused=True),
    "torch-checkpoint": dict(checkpoint=True, fused=False),
    "no-recompute": dict(checkpoint=False),
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_matches_naive_values_and_gradients(mode, temperature, with_bias, dtype, atol):
    args = _inputs(dtype, with_bias)
    ref = _run(naive_logprobs_entropy, *args, temperature=temperature)
    got = _run(chunked_logprobs_entropy, *args, temperature=temperature, chunk_size=8, **MODES[mode])
    assert got[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(got[0], ref[0], atol=atol, rtol=0)
    torch.testing.assert_close(got[1], ref[1], atol=atol, rtol=0)
    assert got[0][3] == 0 and got[0][20] == 0  # ignore_index
    for g_got, g_ref in zip(got[2], ref[2]):
        torch.testing.assert_close(g_got, g_ref, atol=atol, rtol=0)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_partial_uses_and_frozen_head(mode):
    """Only log-probs in the loss, entropy returned but unused, and a frozen head (LoRA-style)."""
    hidden, weight, bias, labels, coeff = _inputs(torch.float64, True)
    for compute_entropy in (True, False):
        grads = []
        for fn, kw in (
            (naive_logprobs_entropy, {}),
            (chunked_logprobs_entropy, {"chunk_size": 6, **MODES[mode]}),
        ):
            hidden.grad = None
            logp, _ = fn(
                hidden, weight.detach(), labels, bias=bias.detach(), compute_entropy=compute_entropy, **kw
            )
            (coeff[0] * logp).sum().backward()
            grads.append(hidden.grad.clone())
        torch.testing.assert_close(grads[1], grads[0], atol=1e-10, rtol=0)


def test_bf16_inputs_are_computed_in_fp32():
    hidden, weight, _, labels, _ = _inputs(torch.float32, False)
    logp, ent = chunked_logprobs_entropy(hidden.bfloat16(), weight.bfloat16(), labels, chunk_size=10)
    ref_logp, ref_ent = naive_logprobs_entropy(hidden.bfloat16(), weight.bfloat16(), labels)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)


def test_tied_embeddings_gradient_from_both_uses():
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (N,), generator=g)
    labels = torch.roll(ids, -1)
    mix = torch.randn(H, H, generator=g, dtype=torch.float64)
    grads = []
    for fn, kw in ((naive_logprobs_entropy, {}), (chunked_logprobs_entropy, {"chunk_size": 5})):
        emb.grad = None
        hidden = torch.tanh(emb[ids] @ mix)  # the embedding feeds the input side too
        logp, ent = fn(hidden, emb, labels, **kw)
        (logp.sum() - 0.1 * ent.sum()).backward()
        grads.append(emb.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-10, rtol=0)


def test_no_grad_and_no_entropy_paths():
    hidden, weight, _, labels, _ = _inputs(torch.float32, False)
    with torch.no_grad():
        logp, ent = chunked_logprobs_entropy(hidden, weight, labels, chunk_size=4, compute_entropy=False)
        ref, _ = naive_logprobs_entropy(hidden, weight, labels)
    assert ent is None and not logp.requires_grad
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=0)


def _saved_bytes(fn, *args, **kw) -> int:
    """Bytes autograd keeps for backward (distinct storages): the memory checkpointing is meant to avoid."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kw)
    return sum(storages.values())


@pytest.mark.parametrize("fused", [True, False])
def test_checkpoint_does_not_keep_full_logits(fused):
    n, h, v = 512, 16, 4096
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    full = n * v * 4
    naive = _saved_bytes(naive_logprobs_entropy, hidden, weight, labels)
    chunked = _saved_bytes(chunked_logprobs_entropy, hidden, weight, labels, chunk_size=64, fused=fused)
    assert naive >= 2 * full
    assert chunked < full / 8  # only inputs and per-token outputs: no [N, V] tensor saved


def test_shape_errors():
    with pytest.raises(ValueError, match="shape"):
        chunked_logprobs_entropy(torch.zeros(4, 3), torch.zeros(5, 2), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs_entropy(
            torch.zeros(4, 3), torch.zeros(5, 3), torch.zeros(4, dtype=torch.long), chunk_size=0
        )


def test_packed_hidden_states_through_chunked_head_match_model_logits():
    torch.manual_seed(0)
    config = tiny_qwen2_config(120)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, 120, (n,), generator=g) for n in (5, 9, 2, 7)]
    packed = pack_sequences(seqs, 12)
    labels = packed.next_token_labels()
    valid = labels != -100
    with torch.no_grad():
        logits = packed_causal_lm_forward(model, packed)
        hidden = packed_causal_lm_forward(model, packed, output="hidden")
    weight, bias = lm_head_parameters(model)
    assert weight is model.get_input_embeddings().weight  # tied
    logp, ent = chunked_logprobs_entropy(
        hidden[valid], weight.detach(), labels[valid], bias=bias, chunk_size=7
    )
    ref = torch.log_softmax(logits[valid], -1).gather(-1, labels[valid].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=0)
    assert (ent > 0).all()
