"""Incremental rendering, tool-output truncation in tokens, and the template-drift check."""

import pytest

from posttrain.agents.render import (
    Renderer,
    TemplateDriftError,
    truncate_text_to_tokens,
    truncate_tool_output,
)
from posttrain.models.tiny import build_tiny_tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
]


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_incremental_tokens_equal_a_whole_rendering(tok, tools):
    r = Renderer(tok, tools=tools)
    prompt = [{"role": "user", "content": "What is 12 * 34?"}]
    assistant = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    new = [{"role": "tool", "content": "408"}, {"role": "tool", "content": "ok"}]
    # what the engine samples: the assistant text and the end-of-turn token
    sampled = tok(assistant, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = r.prompt_ids(prompt) + sampled + r.new_message_ids(new)
    whole = r.render([*prompt, {"role": "assistant", "content": assistant}, *new], add_generation_prompt=True)
    assert ids == whole
    env_text = tok.decode(r.new_message_ids(new))
    assert env_text.startswith("\n<|im_start|>user\n<tool_response>\n408") and env_text.endswith(
        "assistant\n"
    )
    assert r.drift(prompt + [{"role": "assistant", "content": assistant}] + new, ids).drifted is False


def test_a_template_that_rewrites_history_is_detected(tok):
    # a template that numbers the messages from the end: adding a message changes every earlier one
    tok2 = build_tiny_tokenizer()
    tok2.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ messages|length - loop.index }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(TemplateDriftError, match="first difference at token"):
        Renderer(tok2).new_message_ids([{"role": "user", "content": "more"}])


def test_drift_counts_a_non_canonical_tokenization(tok):
    r = Renderer(tok)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the answer"}]
    canonical = r.render(messages, add_generation_prompt=False)
    assert r.drift(messages, canonical).mismatched_tokens == 0
    # the same text sampled byte by byte: decodes to the same string, but is not the template's tokens
    prompt = r.prompt_ids(messages[:1])
    bytewise = [
        tok.convert_tokens_to_ids(t) for t in tok.convert_ids_to_tokens(tok("the answer")["input_ids"])
    ]
    spelled = []
    for t in tok.convert_ids_to_tokens(bytewise):
        spelled += [tok.convert_tokens_to_ids(ch) for ch in t]
    assert tok.decode(spelled) == "the answer" and len(spelled) > len(bytewise)
    report = r.drift(messages, prompt + spelled + [tok.eos_token_id])
    assert report.drifted and report.first_mismatch >= len(prompt)


@pytest.mark.parametrize("side", ["left", "middle", "right"])
def test_truncation_counts_tokens_and_keeps_an_exact_fit(tok, side):
    text = " ".join(str(i) for i in range(200))
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    assert truncate_text_to_tokens(tok, text, n, side) == (text, 0)  # exactly fits: kept
    out, dropped = truncate_text_to_tokens(tok, text, 40, side)
    assert len(tok(out, add_special_tokens=False)["input_ids"]) <= 40 and dropped > 0
    assert "...(truncated)..." in out
    if side == "left":
        assert out.startswith("0 1 2")
    elif side == "right":
        assert out.endswith("198 199")
    else:
        assert out.startswith("0 1") and out.endswith("199")
    tiny, _ = truncate_text_to_tokens(tok, text, 3, side)  # no room for the marker
    assert len(tok(tiny, add_special_tokens=False)["input_ids"]) <= 3


def test_a_bad_side_is_a_config_error(tok):
    with pytest.raises(ValueError, match="tool_response_truncate_side='top'"):
        truncate_text_to_tokens(tok, "x " * 50, 5, "top")


class _CountingTokenizer:
    """The real tokenizer, counting the characters it is given to encode."""

    def __init__(self, tok):
        self.tok, self.encoded_chars = tok, 0

    def __call__(self, text, **kwargs):
        self.encoded_chars += len(text)
        return self.tok(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize("side", ["left", "middle", "right"])
def test_a_huge_tool_output_is_cut_in_characters_before_tokenizing(tok, side):
    """A 5 MB result took 9-13 s per call when tokenized whole; the work is now bounded by the token limit."""
    import time

    huge = "lorem ipsum 12345, " * 270_000  # 5.1 MB
    counting = _CountingTokenizer(tok)
    start = time.perf_counter()
    out, note = truncate_tool_output(counting, huge, 256, side)
    elapsed = time.perf_counter() - start
    assert counting.encoded_chars < 200_000, counting.encoded_chars  # not the 5.1 M characters
    assert elapsed < 2.0
    assert len(tok(out, add_special_tokens=False)["input_ids"]) <= 256 and "...(truncated)..." in out
    assert "characters dropped before tokenizing" in note and "tokens dropped" in note


@pytest.mark.parametrize("side", ["left", "middle", "right"])
@pytest.mark.parametrize("words", [30, 3_000, 12_000])
def test_the_character_cut_leaves_the_token_truncation_unchanged(tok, side, words):
    """On/off equivalence: cutting characters first gives the text token truncation alone gives."""
    text = " ".join(f"w{i % 97}:{i}" for i in range(words))
    alone, dropped = truncate_text_to_tokens(tok, text, 64, side)
    out, note = truncate_tool_output(tok, text, 64, side)
    assert out == alone
    assert (note is None) == (dropped == 0)


def test_no_note_when_the_output_fits(tok):
    assert truncate_tool_output(tok, "408", 64, "middle") == ("408", None)
