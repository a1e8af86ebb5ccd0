"""The built-in tiny model: a byte-level BPE tokenizer and a small Qwen2, both built locally and deterministically.

Tests, examples and CPU benchmarks use it so that nothing is downloaded. The saved directory is a normal Hugging Face
model directory (``model_type=qwen2``), so ``AutoTokenizer``/``AutoModelForCausalLM`` (and vLLM) load it unchanged.

Why byte-level BPE with Qwen2's exact pipeline: ``AutoTokenizer`` on a ``qwen2`` directory builds ``Qwen2Tokenizer``,
which keeps only the vocab and merges and rebuilds the normalizer, pre-tokenizer and decoder itself. Any other
pipeline (e.g. a char-level one) then silently loses spaces on reload. Using the same pipeline here makes the
in-memory tokenizer and the reloaded one identical.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
TINY_VOCAB_SIZE = 512  # 3 special tokens + 256 bytes + 253 learned merges

# Qwen2's split regex (same as transformers' Qwen2Tokenizer): digits are split one by one.
QWEN2_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Qwen2.5-style ChatML template without a default system prompt (keeps tiny prompts short). Without `tools` and
# tool messages it renders exactly like plain ChatML. With `tools` it renders the hermes tool block in the system
# turn; an assistant message's `tool_calls` become `<tool_call>` JSON blocks, and consecutive `tool` messages go
# back in one user turn as `<tool_response>` blocks (what Qwen2.5 and Hermes models are trained on).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set call = call['function'] if call.get('function') else call %}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' + call['name'] + '\\\", \\\"arguments\\\": ' }}"
    "{{- (call['arguments'] if call['arguments'] is string else (call['arguments'] | tojson)) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_ENGLISH_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model learns to answer simple questions.
Let me think step by step. First, I read the question carefully. Then I compute the answer.
What is the sum of these numbers? The answer is the result of adding them together.
What is the product of two numbers? Multiply the first number by the second number.
What is the difference between them? Subtract the smaller number from the larger one.
If there are three apples and you eat one, how many apples are left? There are two apples left.
She has five books and buys four more, so she now has nine books in total.
Count the letters in the word and write the number at the end of your answer.
Reverse the list of numbers and then sort them from the smallest to the largest.
Please answer with a single number. Put the final answer after the word Answer.
The user asks a question and the assistant gives a short, correct and helpful answer.
You are a helpful assistant. Think about the problem, then give the final answer.
Training with reinforcement learning rewards the model when its answer is correct.
Each step samples prompts, generates responses, scores them and updates the policy.
The reward is one when the answer matches the target and zero otherwise.
In the morning the children walk to school, and in the evening they return home.
There are seven days in a week, twelve months in a year and sixty minutes in an hour.
Numbers can be even or odd. An even number can be divided by two without a remainder.
The train leaves the station at eight and arrives in the city two hours later.
Water boils at one hundred degrees, and it freezes at zero degrees.
This is a test of the tokenizer. It should keep every space, tab and new line exactly.
"""


def _arithmetic_corpus() -> list[str]:
    """A deterministic list of arithmetic lines, so that operators and their spacing get their own merges."""
    lines = []
    for a in range(0, 30, 3):
        for b in range(1, 20, 4):
            lines.append(f"Question: What is {a} + {b}?\nAnswer: {a} + {b} = {a + b}\n")
            lines.append(f"Compute {a} * {b} - {b}. Result: {a * b - b}\n")
            lines.append(f"{a} - {b} = {a - b}; ({a} + {b}) / 2 = {(a + b) / 2}\n")
    return lines


def _chat_corpus() -> list[str]:
    """Chat-formatted lines, so role names and the template's newlines are merged like in real use."""
    out = []
    for line in _ENGLISH_CORPUS.splitlines()[:8]:
        out.append(f"{IM_START}user\n{line}{IM_END}\n{IM_START}assistant\n{line}{IM_END}\n")
    return out


def tiny_corpus() -> list[str]:
    """The fixed training corpus of the tiny tokenizer (English + arithmetic + chat turns)."""
    return _ENGLISH_CORPUS.splitlines(keepends=True) * 2 + _arithmetic_corpus() + _chat_corpus()


def _qwen2_pipeline_tokenizer() -> Tokenizer:
    """An empty byte-level BPE with exactly the normalizer/pre-tokenizer/decoder that Qwen2Tokenizer rebuilds."""
    tok = Tokenizer(
        BPE(
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def build_tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train the tiny byte-level BPE on the embedded corpus (deterministic: same output on every call).

    All 256 bytes are in the vocabulary, so any text (any language, any bytes) encodes and decodes exactly.
    Special tokens: ``<|endoftext|>`` (id 0, pad), ``<|im_start|>`` (1), ``<|im_end|>`` (2, eos).
    """
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: it must be >= 259 (3 special tokens + 256 bytes)"
        )
    tok = _qwen2_pipeline_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def tiny_config(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 256,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 768,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = True,
    **overrides: Any,
) -> Qwen2Config:
    """A Qwen2Config sized for CPU work; the defaults give ~3.2 M parameters with the 512-token vocabulary."""
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_id,
        bos_token_id=pad_id,  # Qwen2 convention: no BOS is prepended, the config names <|endoftext|>
        eos_token_id=eos_id,
        **overrides,
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast, seed: int = 0, **config_kwargs: Any
) -> Qwen2ForCausalLM:
    """A randomly initialised fp32 Qwen2ForCausalLM, identical for identical (tokenizer, seed, config_kwargs).

    The global torch RNG is left untouched (initialisation runs inside ``torch.random.fork_rng``).
    ``config_kwargs`` go to :func:`tiny_config` (e.g. ``hidden_size=64, num_hidden_layers=2``).
    """
    config = tiny_config(tokenizer, **config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    # Like Qwen instruct models: generation stops at <|im_end|> or <|endoftext|>.
    eos_ids = [config.eos_token_id, config.pad_token_id]
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos_ids, pad_token_id=config.pad_token_id
    )
    model.eval()
    return model


_MARKER = "posttrain_tiny.json"


def create_tiny_model_dir(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Build the tiny tokenizer + model and save them as a Hugging Face model directory; return the path.

    Idempotent: if ``path`` already holds a tiny model built with the same ``seed`` and ``overrides`` it is reused
    (a marker file written last records them, so an interrupted save is rebuilt).
    """
    path = Path(path)
    spec = {"seed": seed, "overrides": overrides}
    marker = path / _MARKER
    if marker.is_file() and json.loads(marker.read_text()) == json.loads(json.dumps(spec)):
        return path
    path.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    marker.write_text(json.dumps(spec, sort_keys=True))
    return path
