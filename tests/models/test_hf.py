"""Loading/saving local Hugging Face models: dtype option, tokenizer defaults, clear errors."""

import pytest
import torch

from posttrain.models.hf import DTYPES, load_causal_lm, load_tokenizer, resolve_dtype, save_hf
from posttrain.models.tiny import build_tiny_tokenizer, create_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return create_tiny_model_dir(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_hidden_layers=2)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_load_causal_lm_dtype(tiny_dir, name):
    model = load_causal_lm(tiny_dir, dtype=name, device="cpu")
    assert model.dtype == DTYPES[name]
    assert model.config._attn_implementation == "sdpa"


def test_bad_dtype_names_the_parameter(tiny_dir):
    with pytest.raises(ValueError, match="dtype='float64'.*bf16"):
        load_causal_lm(tiny_dir, dtype="float64")
    assert resolve_dtype(torch.bfloat16) is torch.bfloat16


def test_missing_or_non_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_causal_lm(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(ValueError, match="config.json"):
        load_causal_lm(tmp_path)
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)


def test_load_tokenizer_left_pads(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    assert tok.padding_side == "left" and tok.pad_token == "<|endoftext|>"
    batch = tok(["a b c d", "a"], padding=True)
    assert batch["attention_mask"][1][0] == 0


def test_load_tokenizer_sets_missing_pad_to_eos(tmp_path):
    tok = build_tiny_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)  # no config.json: loaded as a plain fast tokenizer
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token == loaded.eos_token == "<|im_end|>"


def test_save_hf_round_trip(tiny_dir, tmp_path):
    model = load_causal_lm(tiny_dir)
    tok = load_tokenizer(tiny_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    out = save_hf(model, tok, tmp_path / "saved")
    assert (out / "model.safetensors").is_file()
    reloaded = load_causal_lm(out)
    ids = torch.tensor([tok.encode("What is 1 + 1?")])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    assert load_tokenizer(out).encode("a  b\n1") == tok.encode("a  b\n1")
