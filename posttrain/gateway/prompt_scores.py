"""Prompt scoring for ``echo=true`` completions: one forward of the served model over the prompt's token ids,
each token's log-prob given the tokens before it (the first has none: null, as OpenAI and vLLM answer), at the
request's temperature (logits / temperature before the softmax, as the sampler's and the trainer's log-probs).

The forward runs in the handler's thread, beside the engine thread's generation (a forward-only pass reads the
weights and changes nothing); one prompt at a time, under a lock, so a burst of scoring requests does not hold
several full-vocabulary logit tensors at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class PromptScores:
    """``logprobs[i]``: the log-prob of ``ids[i]`` (None for i = 0); ``top[i]``: the ``k`` most likely token ids
    at position i and their log-probs (None for i = 0; empty dicts when k = 0)."""

    logprobs: list[float | None]
    top: list[dict[int, float] | None]


class PromptScorer:
    """The served model's prompt log-probs (``posttrain serve`` with the native engine)."""

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu") -> None:
        self.model = model
        self.device = torch.device(device)
        self._lock = threading.Lock()

    @torch.no_grad()
    def __call__(self, ids: list[int], temperature: float, k: int) -> PromptScores:
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        with self._lock:
            logits = self.model(input_ids=tokens).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        picked = logprobs.gather(-1, tokens[0, 1:].unsqueeze(-1)).squeeze(-1).tolist()
        top: list[dict[int, float] | None] = [None]
        if k > 0:
            values, indices = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
            top += [dict(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        else:
            top += [{} for _ in picked]
        return PromptScores([None, *picked], top)
