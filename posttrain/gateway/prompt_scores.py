"""Prompt scoring for ``echo=true`` completions: a forward of the served model over the prompt's token ids, each
token's log-prob given the tokens before it (the first has none: null, as OpenAI and vLLM answer), at the
request's temperature (logits / temperature before the softmax, as the sampler's and the trainer's log-probs).

The forward runs in the handlers' threads, beside the engine thread's generation (a forward-only pass reads the
weights and changes nothing). Requests that arrive while a forward runs wait for it and then go together: the
thread that takes the model next runs one right-padded forward over all the waiting prompts (up to
``max_batch_tokens`` padded tokens), so a remote distillation teacher's concurrent requests cost a few forwards,
not one each, and a burst never holds more than one batch's full-vocabulary logits at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class PromptScores:
    """``logprobs[i]``: the log-prob of ``ids[i]`` (None for i = 0); ``top[i]``: the ``k`` most likely token ids
    at position i and their log-probs (None for i = 0; empty dicts when k = 0)."""

    logprobs: list[float | None]
    top: list[dict[int, float] | None]


@dataclass
class _Waiting:
    """A request's prompt, and its logits [len - 1, V] once a forward has run over it."""

    ids: list[int]
    logits: torch.Tensor | None = None
    error: BaseException | None = None  # the batch's forward failed
    done: threading.Event = field(default_factory=threading.Event)


class PromptScorer:
    """The served model's prompt log-probs (``posttrain serve`` with the native engine). ``forwards`` counts the
    model calls (a batch of waiting prompts is one)."""

    def __init__(
        self, model: nn.Module, device: torch.device | str = "cpu", max_batch_tokens: int = 8192
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.max_batch_tokens = max_batch_tokens
        self.forwards = 0
        self._model_lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._queue: list[_Waiting] = []

    def __call__(self, ids: list[int], temperature: float, k: int) -> PromptScores:
        waiting = _Waiting(list(ids))
        with self._queue_lock:
            self._queue.append(waiting)
        while not waiting.done.is_set():
            with self._model_lock:
                # another thread's batch may have taken it meanwhile; or, past the token budget, the batch
                # taken now may end before it (then the loop takes the next)
                if not waiting.done.is_set():
                    self._run(self._take())
        if waiting.error is not None:
            raise RuntimeError("the prompt-scoring forward of this request's batch failed") from waiting.error
        return _scores(waiting.ids, waiting.logits / temperature, k)

    def _take(self) -> list[_Waiting]:
        """The waiting prompts of the next batch (in arrival order): as many as fit the padded-token budget, and
        at least one."""
        with self._queue_lock:
            n, longest = 0, 0
            while n < len(self._queue):
                longest = max(longest, len(self._queue[n].ids))
                if n and longest * (n + 1) > self.max_batch_tokens:
                    break
                n += 1
            batch, self._queue = self._queue[:n], self._queue[n:]
        return batch

    @torch.no_grad()
    def _run(self, batch: list[_Waiting]) -> None:
        width = max(len(w.ids) for w in batch)
        tokens = torch.zeros(len(batch), width, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(tokens)
        for i, w in enumerate(batch):
            tokens[i, : len(w.ids)] = torch.tensor(w.ids, device=self.device)
            mask[i, : len(w.ids)] = 1
        try:
            # Right padding: a causal model's logits at a real position never see the pads after it.
            logits = self.model(input_ids=tokens, attention_mask=mask).logits.float()
            self.forwards += 1
            for i, w in enumerate(batch):
                w.logits = logits[i, : len(w.ids) - 1].clone()
        except BaseException as exc:
            for w in batch:  # the batch's other requests fail with it rather than wait forever
                w.error = exc
            raise
        finally:
            for w in batch:
                w.done.set()


def _scores(ids: list[int], logits: torch.Tensor, k: int) -> PromptScores:
    logprobs = torch.log_softmax(logits, dim=-1)
    picked = (
        logprobs.gather(-1, torch.tensor(ids[1:], device=logits.device).unsqueeze(-1)).squeeze(-1).tolist()
    )
    top: list[dict[int, float] | None] = [None]
    if k > 0:
        values, indices = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        top += [dict(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        top += [{} for _ in picked]
    return PromptScores([None, *picked], top)
