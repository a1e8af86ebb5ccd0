"""The built-in tiny tokenizer and model: determinism, exact text round trip through a saved dir, loading."""

import torch
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.models.tiny import (
    IM_END,
    IM_START,
    PAD_TOKEN,
    TINY_VOCAB_SIZE,
    build_tiny_model,
    build_tiny_tokenizer,
    create_tiny_model_dir,
)

SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64}
TEXTS = [
    "Hello  world!\n\n  What is 123 + 4567?\tAnswer: 4690.  ",
    " leading space, trailing newline\n",
    "x\r\ny  \n\n\nz 0.5 -7 1e10 (3*4)/2=6",
    "unicode: é ü ß 你好 🙂 and café",
    f"{IM_START}user\nWhat is 2 + 2?{IM_END}\n{IM_START}assistant\n4{IM_END}",
]


def test_tokenizer_is_deterministic_and_complete():
    a, b = build_tiny_tokenizer(), build_tiny_tokenizer()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert len(a) == TINY_VOCAB_SIZE
    assert a.convert_tokens_to_ids([PAD_TOKEN, IM_START, IM_END]) == [0, 1, 2]
    assert a.pad_token == PAD_TOKEN and a.eos_token == IM_END and a.bos_token is None
    # Every byte has a token, so any text is representable.
    vocab = a.get_vocab()
    assert all(char in vocab for char in pre_tokenizers.ByteLevel.alphabet())
    for text in TEXTS:
        assert a.decode(a.encode(text)) == text


def test_digits_split_individually():
    tok = build_tiny_tokenizer()
    assert [t for t in tok.tokenize("x 12345") if t.strip("Ġ").isdigit()] == list("12345")


def test_model_is_deterministic_from_seed_and_leaves_global_rng_alone():
    tok = build_tiny_tokenizer()
    state = torch.random.get_rng_state()
    m0, m0b, m1 = (build_tiny_model(tok, seed=s, **SMALL) for s in (0, 0, 1))
    assert torch.equal(state, torch.random.get_rng_state())
    sd0, sd0b, sd1 = m0.state_dict(), m0b.state_dict(), m1.state_dict()
    assert all(torch.equal(sd0[k], sd0b[k]) for k in sd0)
    assert not torch.equal(sd0["model.layers.0.mlp.up_proj.weight"], sd1["model.layers.0.mlp.up_proj.weight"])
    assert m0.dtype == torch.float32
    assert (m0.config.eos_token_id, m0.config.pad_token_id) == (2, 0)


def test_default_size_is_about_three_million_params():
    model = build_tiny_model(build_tiny_tokenizer())
    n = sum(p.numel() for p in model.parameters())
    assert 2.5e6 < n < 4e6


def test_chat_template():
    tok = build_tiny_tokenizer()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"


def test_saved_dir_round_trips_through_auto_classes(tmp_path):
    path = create_tiny_model_dir(tmp_path / "tiny", seed=3, **SMALL)
    tok = build_tiny_tokenizer()
    loaded = AutoTokenizer.from_pretrained(path, local_files_only=True)
    for text in TEXTS:
        ids = loaded.encode(text)
        assert ids == tok.encode(text)
        assert loaded.decode(ids) == text
    assert loaded.eos_token == IM_END and loaded.pad_token == PAD_TOKEN
    chat = [{"role": "user", "content": "hi 12"}]
    assert loaded.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    ) == tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    reference = build_tiny_model(tok, seed=3, **SMALL)
    ids = torch.tensor([tok.encode(TEXTS[0])])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert 2 in model.generation_config.eos_token_id


def test_create_tiny_model_dir_is_idempotent(tmp_path):
    path = create_tiny_model_dir(tmp_path / "tiny", **SMALL)
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert create_tiny_model_dir(tmp_path / "tiny", **SMALL) == path
    assert weights.stat().st_mtime_ns == stamp
    create_tiny_model_dir(tmp_path / "tiny", seed=1, **SMALL)  # different spec: rebuilt in place
    assert weights.stat().st_mtime_ns != stamp
