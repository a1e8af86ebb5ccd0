"""A process reward model (PRM): a score for each reasoning step of a response, placed on the response's tokens.

The PRM is a Hugging Face ``AutoModelForTokenClassification`` with two labels (1: the step is correct) whose
config holds ``step_separator``, the text it was trained with after each step (TRL's PRMTrainer layout). It
reads the prompt's tokens, then each step's tokens followed by the separator's; a step's score is
``softmax(logits)[1]`` at the last token of that step's separator.

The policy's response is cut into steps on its text (``reward.prm.separator``, a string or a regex; by default the
PRM's own separator), but the scores go on the SAMPLED tokens: each step ends at the first response token whose
decoded prefix covers the step's text and the separator that follows it (the last step: its text). Only the PRM's
input is tokenized anew; the policy's tokens are never re-tokenized. Multi-turn samples are cut per assistant
span (the tokens the policy sampled), so the environment's tokens get no step and no score.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForTokenClassification, AutoTokenizer, PretrainedConfig

from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.models.hf import read_model_config
from posttrain.rewards.prm_layout import stepwise_input

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
REDUCTIONS = ("dense", "min", "mean", "last")
DEFAULT_SEPARATOR = "\n"  # the separator of a PRM whose config names none (TRL's default)


def check_prm_dir(path: str | Path, key: str = "reward.prm.path") -> PretrainedConfig:
    """The PRM's config, checked before any weights load: a local directory of a token classifier with two
    labels. A causal LM or a sequence classifier would load with a fresh head and score noise."""
    if not path or not Path(path).is_dir():
        raise ConfigError(
            f"{key}={str(path)!r} is not a directory; the process reward model is a local directory holding an "
            "AutoModelForTokenClassification with two labels and step_separator in its config (docs/judges.md)"
        )
    config = read_model_config(path, key)
    kinds = config.architectures or []
    if kinds and not any(k.endswith("ForTokenClassification") for k in kinds):
        raise ConfigError(
            f"{key}={str(path)!r} is a {kinds[0]}, not a token classifier; a process reward model is an "
            "AutoModelForTokenClassification with num_labels=2 (label 1: step correct)"
        )
    if config.num_labels != 2:
        raise ConfigError(
            f"{key}={str(path)!r} has num_labels={config.num_labels}; a process reward model needs num_labels=2 "
            "(label 1: the step is correct)"
        )
    return config


def step_pattern(separator: str, is_regex: bool) -> re.Pattern:
    """The pattern that ends a step: ``separator`` taken literally, or as a regex (checked with the config:
    posttrain.config.validate)."""
    return re.compile(separator if is_regex else re.escape(separator))


def split_steps(text: str, pattern: re.Pattern) -> list[tuple[str, int]]:
    """(step text, character end of the step and its separator) for each non-empty step of ``text``. A text
    with no separator is one step; a trailing separator ends the last step; empty steps (two separators in a
    row) are skipped."""
    steps, start = [], 0
    for match in pattern.finditer(text):
        if match.start() > start:
            steps.append((text[start : match.start()], match.end()))
        start = match.end()
    if start < len(text):
        steps.append((text[start:], len(text)))
    return steps


def token_ends(ids: Sequence[int], char_ends: Sequence[int], decode) -> list[int]:
    """For each character offset in ``char_ends`` (increasing), the index of the first token of ``ids`` whose
    decoded prefix reaches it (binary search over prefixes; ``decode`` as the reward's text was decoded)."""
    out, lo = [], 0
    for end in char_ends:
        a, b = lo, len(ids) - 1
        while a < b:
            mid = (a + b) // 2
            if len(decode(ids[: mid + 1])) >= end:
                b = mid
            else:
                a = mid + 1
        out.append(a)
        lo = a
    return out


def trained_spans(mask: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of trained (mask 1) tokens: the assistant's spans."""
    spans, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


@dataclass(frozen=True)
class Steps:
    """One response's steps: their texts and the index (in the response's tokens) of each step's last token."""

    texts: list[str]
    ends: list[int]


def response_steps(ids: Sequence[int], mask: Sequence[int] | None, pattern: re.Pattern, tokenizer) -> Steps:
    """The steps of one sampled response, cut in each trained span (all of it for single-turn samples)."""
    mask = [1] * len(ids) if mask is None else mask
    texts, ends = [], []

    def decode(part):
        return tokenizer.decode(part, skip_special_tokens=True)

    for start, stop in trained_spans(mask):
        span = list(ids[start:stop])
        steps = split_steps(decode(span), pattern)
        texts += [text for text, _ in steps]
        ends += [start + i for i in token_ends(span, [end for _, end in steps], decode)]
    return Steps(texts, ends)


def reduce_steps(scores: Sequence[float], reduction: str) -> float:
    """One score from a response's step scores (0 for a response with no step: counted as reward/prm/no_steps)."""
    if not scores:
        return 0.0
    if reduction == "min":
        return min(scores)
    if reduction == "last":
        return scores[-1]
    return sum(scores) / len(scores)  # mean (and dense's mean, for the metric)


class ProcessRewardScorer:
    """A PRM and its tokenizer: the score of each step of (prompt, steps) inputs.

    Args:
        path: the PRM's directory (model and tokenizer).
        micro_batch_size: responses per forward pass.
        device, dtype: where and in which dtype it runs (``"fp32"``, ``"bf16"``, ``"fp16"``).
    """

    def __init__(
        self, path: str | Path, micro_batch_size: int = 8, device="cpu", dtype: str = "fp32"
    ) -> None:
        if dtype not in _DTYPES:
            raise ConfigError(f"reward.prm.dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}")
        config = check_prm_dir(path)
        self.separator = getattr(config, "step_separator", None) or DEFAULT_SEPARATOR
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self.model = AutoModelForTokenClassification.from_pretrained(path, dtype=_DTYPES[dtype])
        self.model.to(device).eval().requires_grad_(False)
        self.device = torch.device(device)
        self.micro_batch_size = micro_batch_size
        self.max_length = getattr(config, "max_position_embeddings", None)

    def encode(self, prompt: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        """(input ids, the position of each step's score): :func:`stepwise_input` with the PRM's separator. An
        input longer than the PRM's context (``max_position_embeddings``) is cut there, and the steps whose score
        would lie past it get none (counted by :class:`ProcessReward` as ``reward/prm/cut_steps``): the PRM is
        never read where it was not trained to read."""
        ids, positions = stepwise_input(self.tokenizer, prompt, steps, self.separator)
        if self.max_length and len(ids) > self.max_length:
            ids, positions = ids[: self.max_length], [p for p in positions if p < self.max_length]
        return ids, positions

    @torch.inference_mode()
    def score(self, prompts: Sequence[str], steps: Sequence[Sequence[str]]) -> list[list[float]]:
        """The score (P(label 1)) of each step of each response, in input order."""
        encoded = [self.encode(p, s) for p, s in zip(prompts, steps)]
        out: list[list[float]] = [[] for _ in encoded]
        order = sorted((i for i in range(len(encoded)) if encoded[i][1]), key=lambda i: len(encoded[i][0]))
        for s in range(0, len(order), self.micro_batch_size):
            chunk = order[s : s + self.micro_batch_size]
            longest = max(len(encoded[i][0]) for i in chunk)
            input_ids = torch.full((len(chunk), longest), self.pad_id, dtype=torch.long)
            attention = torch.zeros((len(chunk), longest), dtype=torch.long)
            for row, i in enumerate(chunk):  # right padding: real positions as in an unpadded forward
                ids = encoded[i][0]
                input_ids[row, : len(ids)] = torch.tensor(ids)
                attention[row, : len(ids)] = 1
            logits = self.model(
                input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device)
            ).logits
            correct = logits.float().softmax(-1)[..., 1].cpu()
            for row, i in enumerate(chunk):
                out[i] = correct[row, encoded[i][1]].tolist()
        return out


def prompt_text(prompt) -> str:
    """The prompt as the PRM reads it: a string as it is, chat messages by their contents, one per line."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)


@dataclass(frozen=True)
class ProcessReward:
    """The PRM as a part of the reward: how responses are cut (``pattern``) and how their step scores count
    (``reduction``: dense, min, mean, last)."""

    scorer: ProcessRewardScorer
    pattern: re.Pattern
    reduction: str = "dense"

    def score(
        self,
        prompts: Sequence,
        response_ids: Sequence[Sequence[int]],
        masks: Sequence[Sequence[int]],
        tokenizer,
    ) -> tuple[torch.Tensor, list[list[tuple[int, float]]] | None, dict[str, float]]:
        """([S] each response's PRM reward, the dense placements, the metrics). The reward is the reduction of
        the step scores, or with ``dense`` their sum; the placements (dense only) are (response token index,
        step score) pairs, what :func:`dense_shift` moves from the last token to each step's end."""
        cut = [response_steps(ids, m, self.pattern, tokenizer) for ids, m in zip(response_ids, masks)]
        scores = self.scorer.score([prompt_text(p) for p in prompts], [c.texts for c in cut])
        if self.reduction == "dense":
            values = [sum(s) for s in scores]
            placed = [list(zip(c.ends, s)) for c, s in zip(cut, scores)]
        else:
            values, placed = [reduce_steps(s, self.reduction) for s in scores], None
        n = max(1, len(scores))
        metrics = {
            "reward/prm/mean": sum(
                reduce_steps(s, "mean" if self.reduction == "dense" else self.reduction) for s in scores
            )
            / n,
            "reward/prm/steps": sum(len(s) for s in scores) / n,
            "reward/prm/no_steps": float(sum(not c.texts for c in cut)),
            "reward/prm/cut_steps": float(sum(len(c.texts) - len(s) for c, s in zip(cut, scores))),
        }
        return torch.tensor(values, dtype=torch.float32), placed, metrics


def dense_shift(
    placed: Sequence[Sequence[tuple[int, float]]], last: torch.Tensor, width: int
) -> torch.Tensor:
    """[S, width] what moves each sample's step scores from its last trained token ``last[s]`` (where the
    whole reward, their sum included, was placed) to the end of each step."""
    out = torch.zeros(len(placed), width)
    for s, pairs in enumerate(placed):
        for index, value in pairs:
            out[s, index] += value
            out[s, last[s]] -= value
    return out


def check_prm_config(cfg: PostTrainConfig) -> None:
    """`reward.prm.path` is a two-label token classifier (when the PRM is on), checked before any model loads."""
    if cfg.reward.prm.enable:
        check_prm_dir(cfg.reward.prm.path)


def build_process_reward(cfg: PostTrainConfig, device: torch.device) -> ProcessReward | None:
    """The process reward model of `reward.prm.*`, or None when it is off."""
    p = cfg.reward.prm
    if not p.enable:
        return None
    scorer = ProcessRewardScorer(p.path, p.micro_batch_size_per_gpu, device, p.dtype)
    pattern = step_pattern(p.separator or scorer.separator, p.separator_is_regex and bool(p.separator))
    return ProcessReward(scorer, pattern, p.reduction)
