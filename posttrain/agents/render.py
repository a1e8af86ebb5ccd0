"""Incremental token rendering with the chat template: only the new messages are ever rendered.

The assistant's tokens in a trajectory are the ids the engine sampled, never re-tokenized text. The tokens of the
environment's messages come from the chat template: a fixed dummy conversation is rendered with and without the
new messages; the second must extend the first (checked, else :class:`TemplateDriftError`), and the new tokens are
what follows the dummy's last end-of-turn token (so the template's separator after the end-of-turn token, e.g.
ChatML's newline after ``<|im_end|>``, belongs to the environment's tokens), up to and including the assistant
header of the next turn.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from posttrain.config.errors import ConfigError
from posttrain.config.schema.agents import TRUNCATE_SIDES

TRUNCATION_MARKER = "...(truncated)..."
_DUMMY = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]


class TemplateDriftError(ConfigError):
    """The chat template renders earlier messages differently once new ones follow (no incremental rendering)."""


@dataclass
class DriftReport:
    """How far the trajectory's tokens are from a whole re-rendering of its conversation."""

    mismatched_tokens: int
    first_mismatch: int | None

    @property
    def drifted(self) -> bool:
        return self.mismatched_tokens > 0


class Renderer:
    """Token ids of a conversation's parts through ``tokenizer``'s chat template (with ``tools`` rendered)."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "multi-turn rollouts need a tokenizer with a chat_template; this tokenizer has none"
            )
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.eos_id = tokenizer.eos_token_id

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt of the first turn: the messages (and tools) and the assistant header."""
        return self.render(messages, add_generation_prompt=True)

    def new_message_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The tokens that follow a finished assistant turn: ``messages`` and the next assistant header."""
        before = self.render(_DUMMY, add_generation_prompt=False)
        after = self.render(_DUMMY + list(messages), add_generation_prompt=True)
        if after[: len(before)] != before:
            at = (
                next(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
                if len(after) >= len(before)
                else 0
            )
            raise TemplateDriftError(
                f"the chat template renders a conversation differently once {[m['role'] for m in messages]} "
                f"messages follow (first difference at token {at}); multi-turn rollouts need a template whose "
                "rendering only appends; use such a template (e.g. one that keeps earlier turns unchanged)"
            )
        ends = [i for i, t in enumerate(before) if t == self.eos_id]
        if not ends:
            raise TemplateDriftError(
                f"the chat template does not end an assistant turn with the eos token (id {self.eos_id}); "
                "set the tokenizer's eos_token to the template's end-of-turn token"
            )
        return after[ends[-1] + 1 :]

    def drift(self, messages: list[dict[str, Any]], token_ids: list[int]) -> DriftReport:
        """Compare a trajectory's tokens (prompt and response) with a whole re-rendering of its ``messages``.

        Only the trajectory's length is compared, so a turn cut at the length limit (no end-of-turn token) and the
        template's trailing separator do not count. Assistant messages carry the decoded sampled text.
        """
        ends_with_environment = bool(messages) and messages[-1].get("role") != "assistant"
        expected = self.render(messages, add_generation_prompt=ends_with_environment)
        n = min(len(expected), len(token_ids))
        diffs = [i for i in range(n) if expected[i] != token_ids[i]]
        extra = max(0, len(token_ids) - len(expected))
        first = diffs[0] if diffs else (n if extra else None)
        return DriftReport(mismatched_tokens=len(diffs) + extra, first_mismatch=first)


def truncate_text_to_tokens(
    tokenizer: Any, text: str, max_tokens: int, side: str = "middle"
) -> tuple[str, int]:
    """``text`` cut to at most ``max_tokens`` tokens and the number of its tokens dropped (0: kept whole).

    ``side`` says which part is kept, as verl's ``tool_response_truncate_side``: "left" keeps the beginning,
    "right" the end, "middle" both ends; a marker shows where tokens were dropped and counts against the limit.
    A text that fits exactly is kept unchanged.
    """
    if side not in TRUNCATE_SIDES:
        raise ConfigError(
            f"rollout.multi_turn.tool_response_truncate_side={side!r} must be one of {list(TRUNCATE_SIDES)}"
        )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text, 0
    marker_text = TRUNCATION_MARKER
    marker = len(tokenizer(marker_text, add_special_tokens=False)["input_ids"])
    if marker >= max_tokens:  # no room for the marker: cut without it
        marker_text, marker = "", 0
    budget = max_tokens - marker
    while True:
        head = {"left": budget, "right": 0, "middle": (budget + 1) // 2}[side]
        tail = budget - head
        parts = [tokenizer.decode(ids[:head]) if head else "", marker_text]
        parts.append(tokenizer.decode(ids[len(ids) - tail :]) if tail else "")
        out = "".join(parts)
        if budget == 0 or len(tokenizer(out, add_special_tokens=False)["input_ids"]) <= max_tokens:
            return out, len(ids) - budget
        budget -= 1  # a cut inside a character re-encodes to more tokens: give one up and retry


def truncate_tool_output(
    tokenizer: Any, text: str, max_tokens: int, side: str = "middle"
) -> tuple[str, str | None]:
    """A tool's output within ``max_tokens`` tokens, and a note of what was cut (None: kept whole).

    The text is first cut in characters to what ``max_tokens`` tokens can possibly cover (each token covers at most
    as many characters as the tokenizer's longest token), on the side(s) kept, so the work is bounded whatever the
    tool returned (a 5 MB result took 9-13 s to tokenize whole); then :func:`truncate_text_to_tokens` cuts in
    tokens as before. The margin keeps the kept tokens those of the whole text.
    """
    kept, cut_chars = _cut_characters(text, (max_tokens + 16) * 2 * _longest_token_chars(tokenizer), side)
    out, dropped = truncate_text_to_tokens(tokenizer, kept, max_tokens, side)
    if not cut_chars and not dropped:
        return out, None
    before = f"{cut_chars} characters dropped before tokenizing, then " if cut_chars else ""
    return out, f"tool output: {before}{dropped} tokens dropped ({side})"


def _cut_characters(text: str, keep: int, side: str) -> tuple[str, int]:
    """``text`` cut to ``keep`` characters on each side kept ("middle": both ends), and the characters dropped."""
    if side == "middle":
        if len(text) <= 2 * keep:
            return text, 0
        return text[:keep] + text[-keep:], len(text) - 2 * keep
    if len(text) <= keep:
        return text, 0
    return (text[:keep] if side == "left" else text[-keep:]), len(text) - keep


@functools.lru_cache(maxsize=8)
def _longest_token_chars(tokenizer: Any) -> int:
    """How many characters one token covers at most (the longest vocabulary entry; at least 16)."""
    return max(16, max((len(t) for t in tokenizer.get_vocab()), default=0))
