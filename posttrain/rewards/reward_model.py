"""Score (prompt, response) pairs with a Hugging Face sequence-classification reward model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PretrainedConfig

from posttrain.batching.packing import pack_sequences
from posttrain.batching.token_budget import plan_token_micro_batches
from posttrain.config.errors import ConfigError
from posttrain.models.hf import read_model_config
from posttrain.models.registry import check_packing_supported

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_reward_model_dir(path: str | Path, key: str = "reward.model.path") -> PretrainedConfig:
    """The config of the reward model at ``path``, checked before any weights load: a local model directory
    whose config.json reads, of a sequence classifier with one label. A causal LM would load with a fresh
    two-label head (transformers' default num_labels) and score noise; a classifier with several labels would
    silently score with label 0."""
    if not path or not Path(path).is_dir():
        raise ConfigError(
            f"{key}={str(path)!r} is not a directory; the reward model is a local directory holding an "
            "AutoModelForSequenceClassification with one label (train one with `posttrain rm`; "
            "docs/reward-models.md)"
        )
    config = read_model_config(path, key)
    kinds = config.architectures or []
    if kinds and not any(k.endswith("ForSequenceClassification") for k in kinds):
        raise ConfigError(
            f"{key}={str(path)!r} is a {kinds[0]}, not a sequence classifier; a reward model is an "
            "AutoModelForSequenceClassification with num_labels=1 (a scalar head): train one from this model "
            "with `posttrain rm` (docs/reward-models.md)"
        )
    if config.num_labels != 1:
        raise ConfigError(
            f"{key}={str(path)!r} has num_labels={config.num_labels}; a reward model needs num_labels=1 "
            "(a single scalar head)"
        )
    return config


class RewardModelScorer:
    """A reward model (``AutoModelForSequenceClassification`` with ``num_labels=1``) and its tokenizer.

    The text scored is the chat-templated conversation (user prompt, assistant response) when the reward
    model's tokenizer has a chat template, else ``prompt + response``. The score is the model's output at
    the last real token. Sequences are right-padded (positions of real tokens then match an unpadded
    forward) and sorted by length into micro-batches to waste little compute on padding.

    Args:
        path: directory with the model and its tokenizer.
        micro_batch_size: sequences per forward pass (when max_tokens is None).
        device: where the model runs.
        dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        max_tokens: token budget of one forward pass (dynamic batch size); None: fixed micro_batch_size.
        remove_padding: pack each micro-batch's sequences into rows of at most max_row_tokens tokens
            (architectures verified in posttrain.models.registry) instead of padding them.
        max_length: longest input in tokens; longer ones keep their LAST ``max_length`` tokens (the
            response end the score is read at). None: no truncation.
    """

    def __init__(
        self,
        path: str | Path,
        micro_batch_size: int = 8,
        device: str | torch.device = "cpu",
        dtype: str = "fp32",
        max_length: int | None = None,
        max_tokens: int | None = None,
        remove_padding: bool = False,
        max_row_tokens: int = 512,
    ) -> None:

        if dtype not in _DTYPES:
            raise ConfigError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}")
        if micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size={micro_batch_size} must be >= 1")
        if max_length is not None and max_length < 1:
            raise ConfigError(f"max_length={max_length} must be >= 1, or None for no truncation")
        if max_tokens is not None and max_length is not None and max_tokens < max_length:
            raise ConfigError(
                f"max_tokens={max_tokens} (token budget per forward pass) must be >= max_length={max_length}"
            )
        check_reward_model_dir(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token is None:
                raise ConfigError(
                    f"reward model tokenizer in {path} has neither a pad nor an eos token; add one"
                )
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=_DTYPES[dtype])
        if self.model.config.pad_token_id is None:
            # The HF head finds the last real token through pad_token_id; it must match the tokenizer.
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(device).eval().requires_grad_(False)
        self.device = torch.device(device)
        self.micro_batch_size = micro_batch_size
        self.max_length = max_length
        self.max_tokens = max_tokens
        self.remove_padding = remove_padding
        self.max_row_tokens = max_row_tokens
        if remove_padding:
            check_packing_supported(self.model.config)
            if not isinstance(getattr(self.model, "score", None), torch.nn.Linear):
                raise ConfigError(
                    f"reward model {path} ({type(self.model).__name__}) has no linear `score` head, so packed "
                    "scoring cannot read it; set reward.model.use_remove_padding=false"
                )

    def format(self, prompt: str | list[dict[str, str]], response: str) -> str:
        """The text the reward model reads for one sample."""
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            messages.append({"role": "assistant", "content": response})
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        if not isinstance(prompt, str):
            raise ConfigError(
                "the reward model tokenizer has no chat_template, so chat-message prompts cannot be "
                "rendered; use plain-string prompts or a reward model with a chat template"
            )
        return prompt + response

    def _encode(self, text: str) -> list[int]:
        # A chat template already holds BOS etc.; plain text gets the tokenizer's own special tokens.
        templated = bool(getattr(self.tokenizer, "chat_template", None))
        ids = self.tokenizer(text, add_special_tokens=not templated)["input_ids"]
        if self.max_length is not None and len(ids) > self.max_length:
            ids = ids[-self.max_length :]
        return ids

    @torch.inference_mode()
    def score(self, prompts: Sequence[str | list[dict[str, str]]], responses: Sequence[str]) -> list[float]:
        """One scalar reward per (prompt, response) pair, in input order."""
        if len(prompts) != len(responses):
            raise ConfigError(
                f"got {len(prompts)} prompts but {len(responses)} responses; pass one per sample"
            )
        encoded = [self._encode(self.format(p, r)) for p, r in zip(prompts, responses)]
        scores = [0.0] * len(encoded)
        for chunk in self._micro_batches([len(ids) for ids in encoded]):
            for i, value in zip(chunk, self._forward([encoded[i] for i in chunk])):
                scores[i] = value
        return scores

    def _micro_batches(self, lengths: list[int]) -> list[list[int]]:
        """Fixed-size groups of similar lengths, or token-budget groups (hard cap) when max_tokens is set."""
        if self.max_tokens is not None:
            return plan_token_micro_batches(lengths, self.max_tokens)
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        return [order[s : s + self.micro_batch_size] for s in range(0, len(order), self.micro_batch_size)]

    def _forward(self, batch: list[list[int]]) -> list[float]:
        if self.remove_padding:
            return self._forward_packed(batch)
        longest = max(len(ids) for ids in batch)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(batch), longest), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
        logits = self.model(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device)
        ).logits
        return logits[:, 0].float().cpu().tolist()

    def _forward_packed(self, batch: list[list[int]]) -> list[float]:
        """Pack the sequences into rows (no pad tokens computed) and read the head at each sequence's
        last token; the same scores as the padded forward (tested)."""
        longest = max(len(ids) for ids in batch)
        packed = pack_sequences(
            [torch.tensor(ids, dtype=torch.long) for ids in batch],
            max(self.max_row_tokens, longest),
            pad_token_id=self.tokenizer.pad_token_id,
        )
        # No attention mask and no cache: transformers then reads sequence boundaries from position_ids.
        hidden = self.model.base_model(
            input_ids=packed.input_ids.to(self.device),
            position_ids=packed.position_ids.to(self.device),
            attention_mask=None,
            use_cache=False,
        ).last_hidden_state
        rows = torch.tensor(packed.seq_rows)
        last = torch.tensor(packed.seq_starts) + torch.tensor(packed.seq_lens) - 1
        return self.model.score(hidden[rows, last])[:, 0].float().cpu().tolist()
