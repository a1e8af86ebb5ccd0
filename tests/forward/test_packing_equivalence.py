"""Packed (remove-padding) forward equals the padded forward, per sequence, in values and gradients.

This is the verification test behind posttrain.models.registry: to accept a new architecture, add a tiny
config for it to TINY_CONFIGS and run ``pytest tests/models/test_packing_equivalence.py -k <model_type>``.
Values and gradients are fp32-close (tests.helpers): a packed row runs other shapes in another order.
"""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from posttrain.batching.packing import pack_sequences
from posttrain.forward.packed import lm_head_parameters, packed_causal_lm_forward
from posttrain.models.registry import PACKING_VERIFIED, check_packing_supported, is_packing_supported
from tests.helpers import assert_fp32_close

pytestmark = pytest.mark.numerics  # runs again under other CPU instruction sets in CI

_COMMON = dict(
    vocab_size=160,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)

TINY_CONFIGS = {
    "qwen2": lambda: Qwen2Config(**_COMMON),
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=8),
    "llama": lambda: LlamaConfig(**_COMMON),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=None),
    "gemma": lambda: GemmaConfig(**{**_COMMON, "tie_word_embeddings": True}, head_dim=8),
}

LENGTHS = [9, 3, 14, 1, 6, 11, 2, 7]  # includes 1- and 2-token sequences
MAX_ROW_TOKENS = 18  # several rows, several sequences per row, and row-end padding


def _model(model_type: str, attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[model_type](), attn_implementation=attn)
    return model.float().eval()  # eval: no dropout, so both layouts see the same function


def _sequences(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, vocab, (n,), generator=g) for n in LENGTHS]


def _padded_logits(model, seqs) -> list[torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return [logits[i, : len(s)] for i, s in enumerate(seqs)]


def _loss(per_seq_logits, seqs) -> torch.Tensor:
    # next-token cross-entropy on every valid position, plus a term on the logits themselves so gradients
    # also flow from the last token of each sequence
    total = torch.zeros(())
    for logits, s in zip(per_seq_logits, seqs):
        if len(s) > 1:
            total = total + torch.nn.functional.cross_entropy(logits[:-1], s[1:], reduction="sum")
        total = total + 0.01 * logits.square().mean()
    return total


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_packed_equals_padded(model_type, attn):
    model = _model(model_type, attn)
    assert model.config.model_type == model_type
    seqs = _sequences(model.config.vocab_size)

    model.zero_grad()
    padded = _padded_logits(model, seqs)
    _loss(padded, seqs).backward()
    padded_grads = _grads(model)

    model.zero_grad()
    packed = pack_sequences(seqs, MAX_ROW_TOKENS)
    assert packed.num_rows > 1 and packed.num_rows < len(seqs)  # really packed, in several rows
    packed_logits = packed.unpack(packed_causal_lm_forward(model, packed))
    _loss(packed_logits, seqs).backward()
    packed_grads = _grads(model)

    for i, (a, b) in enumerate(zip(padded, packed_logits)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=f"logits of sequence {i}")
    assert padded_grads.keys() == packed_grads.keys()
    for name in padded_grads:
        assert_fp32_close(packed_grads[name], padded_grads[name], msg=name)


@pytest.mark.parametrize("model_type", ["qwen2", "gemma"])
def test_hidden_output_times_head_equals_logits(model_type):
    model = _model(model_type, "sdpa")
    packed = pack_sequences(_sequences(model.config.vocab_size), MAX_ROW_TOKENS)
    with torch.no_grad():
        logits = packed_causal_lm_forward(model, packed)
        hidden = packed_causal_lm_forward(model, packed, output="hidden")
        weight, bias = lm_head_parameters(model)
    assert bias is None
    torch.testing.assert_close(hidden @ weight.t(), logits, atol=1e-5, rtol=0)


def test_registry_covers_the_tested_architectures():
    assert set(TINY_CONFIGS) <= set(PACKING_VERIFIED)
    for model_type, make in TINY_CONFIGS.items():
        assert is_packing_supported(make())
        assert check_packing_supported(model_type).model_type == model_type


def test_unverified_architecture_is_refused_with_instructions():
    with pytest.raises(ValueError, match=r"model_type='mamba'.*test_packing_equivalence.*registry"):
        check_packing_supported("mamba")

    class FakeConfig:
        model_type = "gpt_bigcode"

    class FakeModel(torch.nn.Module):
        config = FakeConfig()

    packed = pack_sequences([torch.tensor([1, 2, 3])])
    with pytest.raises(ValueError, match="gpt_bigcode"):
        packed_causal_lm_forward(FakeModel(), packed)


def test_flash_attention_layout_is_one_flattened_row():
    """transformers' flash-attention varlen path reads packing from position ids only for a single row."""

    class Config:
        model_type = "qwen2"
        _attn_implementation = "flash_attention_2"

    class Output:
        def __init__(self, logits):
            self.logits = logits

    class RecordingModel(torch.nn.Module):
        config = Config()

        def forward(self, input_ids, position_ids, attention_mask, use_cache):
            self.seen = (tuple(input_ids.shape), tuple(position_ids.shape), attention_mask, use_cache)
            # a per-token function of (id, position) so the reshape back can be checked exactly
            return Output(torch.stack([input_ids, position_ids], dim=-1).float())

    model = RecordingModel()
    packed = pack_sequences(_sequences(50), MAX_ROW_TOKENS)
    out = packed_causal_lm_forward(model, packed)
    assert model.seen == ((1, packed.input_ids.numel()), (1, packed.input_ids.numel()), None, False)
    assert torch.equal(out[..., 0].long(), packed.input_ids)
    assert torch.equal(out[..., 1].long(), packed.position_ids)
