"""A judge loaded in this process (``reward.judge.path``): any causal LM directory answering the rubric's
questions with ``generate``, in batches of ``reward.judge.batch_size`` (docs/judges.md, "A local judge").

The messages are rendered with the tokenizer's chat template and its generation prompt. A tokenizer without a
template gets a plain transcript instead: one ``role: content`` line per message, then ``assistant:``, the
same text for every call so the verdicts stay reproducible.

Greedy decoding (``temperature=0``) in fp32 gives the same verdict for a question whatever else shares its batch:
the prompts are left-padded, the padding masked, and the positions counted from each row's first real token
(half precision may round a padded batch differently and flip a near-tie).
Sampled verdicts (``temperature>0``) draw from the run's torch generator, so they depend on the batching.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from posttrain.models.hf import load_causal_lm, load_tokenizer
from posttrain.rewards.judge.client import Answer


class LocalJudge:
    """A causal LM answering chat messages in this process, with the interface the scorer uses of an endpoint
    (``chat``, ``url``, ``max_retries``, ``failures``, ``retries``) and ``chat_many`` for batches.

    Safe to call from several threads: one ``generate`` runs at a time (a lock), since batching the questions
    is what makes a local model fast, not running several passes side by side.
    """

    max_retries = 0  # a local call is not retried: an error in it is a bug, raised
    failures = 0
    retries = 0

    def __init__(
        self,
        model_dir: str | Path,
        max_tokens: int = 512,
        temperature: float = 0.0,
        batch_size: int = 8,
        dtype: str = "fp32",
        device: str | torch.device = "cpu",
    ) -> None:
        self.url = f"local:{model_dir}"
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.batch_size = batch_size
        # left-padded: every row's last prompt token sits in the same column, where generation starts
        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_causal_lm(model_dir, dtype, device).eval().requires_grad_(False)
        self._lock = threading.Lock()

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text of ``messages``: the chat template with its generation prompt, or, for a tokenizer
        without one, one ``role: content`` line per message followed by ``assistant:``."""
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join([*lines, "assistant:"])

    def chat(self, messages: list[dict[str, str]]) -> Answer:
        """The judge's answer to one conversation."""
        return self.chat_many([messages])[0]

    def chat_many(self, conversations: list[list[dict[str, str]]]) -> list[Answer]:
        """The answers to ``conversations``, in order, generated ``batch_size`` at a time."""
        answers: list[Answer] = []
        for start in range(0, len(conversations), self.batch_size):
            answers += self._generate(conversations[start : start + self.batch_size])
        return answers

    def _generate(self, conversations: list[list[dict[str, str]]]) -> list[Answer]:
        prompts = [self.render(m) for m in conversations]
        with self._lock, torch.inference_mode():
            # the rendered text already holds the template's special tokens: none are added again
            enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = enc.to(self.model.device)
            sampling = (
                {"do_sample": True, "temperature": self.temperature, "top_p": 1.0, "top_k": 0}
                if self.temperature > 0
                else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
            )
            out = self.model.generate(
                **enc,
                max_new_tokens=self.max_tokens,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
                **sampling,
            )
        new = out[:, enc["input_ids"].shape[1] :].tolist()
        prompt_tokens = enc["attention_mask"].sum(dim=1).tolist()
        answers = []
        for ids, prompt in zip(new, prompt_tokens):
            text, generated = self._decode(ids)
            answers.append(Answer(text, int(prompt) + generated))  # the tokens an endpoint reports: both
        return answers

    def _decode(self, ids: list[int]) -> tuple[str, int]:
        """The text of one row's new tokens, up to its first end-of-sequence token (rows that end earlier are
        filled with padding after it), and how many tokens were generated (the end token counted)."""
        eos = self.tokenizer.eos_token_id
        if eos in ids:
            ids = ids[: ids.index(eos) + 1]
        return self.tokenizer.decode(ids, skip_special_tokens=True), len(ids)
