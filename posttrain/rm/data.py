"""Preference pairs for reward-model training: read, check, render and tokenize.

A row holds a prompt and two responses, the preferred one (``chosen``) and the other (``rejected``), each a
string or a list of ``{"role", "content"}`` chat messages; the key names are rm.prompt_key, rm.chosen_key
and rm.rejected_key. A row without the prompt key is an *implicit-prompt* pair: chosen and rejected are
whole conversations (or whole texts) that share their beginning. rm.margin_key names an optional number
per pair.

The text a response is scored on is rendered exactly as the reward-model scorer of `posttrain train`
renders a (prompt, response) sample (posttrain.rewards.reward_model), so a trained model scores there what
it scored here: with a chat template, the conversation [user prompt, assistant response]; without one,
``prompt + response``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.config.errors import DataError, MissingPathError
from posttrain.config.schema import PostTrainConfig
from posttrain.data.datasets import iter_rows  # the shared reader of jsonl/json/parquet/saved datasets

Text = str | list[dict[str, str]]


@dataclass(frozen=True)
class PreferencePair:
    """One row: ``prompt`` is None for an implicit-prompt pair. ``source``: file and row, for errors."""

    prompt: Text | None
    chosen: Text
    rejected: Text
    margin: float
    source: str


@dataclass(frozen=True)
class TokenizedPair:
    chosen_ids: list[int]
    rejected_ids: list[int]
    margin: float


def _check_text(value: Any, where: str, key: str) -> Text:
    """A non-empty string, or a non-empty list of messages with non-empty string content."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: {key!r} is empty; every pair needs non-empty text")
        return value
    if isinstance(value, list) and value:
        for i, m in enumerate(value):
            if not (
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            ):
                raise DataError(
                    f"{where}: {key!r} message {i} is not a {{'role': str, 'content': str}} dict: {m!r}"
                )
        if not any(m["content"].strip() for m in value):
            raise DataError(f"{where}: {key!r} has only empty messages; every pair needs non-empty text")
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise DataError(
        f"{where}: {key!r} must be a non-empty string or a list of chat messages, got {type(value).__name__} "
        f"{value!r:.60}"
    )


def _row_to_pair(row: Any, where: str, rm) -> PreferencePair:
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be an object with {rm.chosen_key!r} and {rm.rejected_key!r}")
    for key, name in ((rm.chosen_key, "rm.chosen_key"), (rm.rejected_key, "rm.rejected_key")):
        if key not in row or row[key] is None:
            raise DataError(
                f"{where}: missing key {key!r} ({name}={key}); the row has {sorted(row)}: set {name} to the "
                "field that holds it"
            )
    chosen = _check_text(row[rm.chosen_key], where, rm.chosen_key)
    rejected = _check_text(row[rm.rejected_key], where, rm.rejected_key)
    prompt = None
    if rm.prompt_key and row.get(rm.prompt_key) is not None:
        prompt = _check_text(row[rm.prompt_key], where, rm.prompt_key)
    _check_roles(chosen, rejected, prompt, where, rm)
    if chosen == rejected:
        raise DataError(
            f"{where}: {rm.chosen_key!r} and {rm.rejected_key!r} are identical; a pair needs two different "
            "responses (remove the row)"
        )
    margin = 0.0
    if rm.margin_key:
        value = row.get(rm.margin_key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DataError(
                f"{where}: rm.margin_key={rm.margin_key} needs a number in every row, got {value!r}; "
                "fill it in or set rm.margin_key=''"
            )
        margin = float(value)
        if not math.isfinite(margin):
            # A NaN margin made every step with the pair skip its update; an infinite one logged a null loss
            # and still stepped.
            raise DataError(
                f"{where}: {rm.margin_key!r} (rm.margin_key) is {value!r}; a margin must be a finite number: "
                "fix or remove the row"
            )
    return PreferencePair(prompt, chosen, rejected, margin, where)


def _check_roles(chosen: Text, rejected: Text, prompt: Text | None, where: str, rm) -> None:
    """A response given as messages ends with the assistant's reply; an implicit-prompt pair's two
    conversations share their prompt (every message before the final assistant reply). Without that a pair
    can be told apart by its prompt alone (accuracy 1.0 in two steps, nothing learnt about the replies)."""
    for key, value in ((rm.chosen_key, chosen), (rm.rejected_key, rejected)):
        if isinstance(value, list) and value[-1]["role"] != "assistant":
            raise DataError(
                f"{where}: {key!r} ends with a {value[-1]['role']!r} message; the reply a pair ranks must be "
                "the last message, with role 'assistant' (put the question in the prompt or in earlier messages)"
            )
    if prompt is not None or isinstance(chosen, str) != isinstance(rejected, str):
        if prompt is None:
            raise DataError(
                f"{where}: {rm.chosen_key!r} and {rm.rejected_key!r} mix a string and chat messages in a row "
                f"without {rm.prompt_key!r}; give both as whole conversations, or add the prompt"
            )
        return
    if isinstance(chosen, str) and not os.path.commonprefix([chosen, rejected]).strip():
        raise DataError(
            f"{where}: {rm.chosen_key!r} and {rm.rejected_key!r} have no prompt key ({rm.prompt_key!r}, "
            "rm.prompt_key), so they must be whole texts that begin with the same prompt, but they share no "
            "beginning at all; the pair would be told apart by its prompt alone. Fix the row, or give the prompt "
            "in its own field"
        )
    if isinstance(chosen, list) and _prompt_of(chosen) != _prompt_of(rejected):
        raise DataError(
            f"{where}: {rm.chosen_key!r} and {rm.rejected_key!r} have no prompt key ({rm.prompt_key!r}, "
            "rm.prompt_key), so they must be conversations that share their prompt (every message before the "
            "last assistant reply), but those messages differ; the pair would be told apart by its prompt "
            "alone. Fix the row, or give the prompt in its own field"
        )


def _prompt_of(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The messages before the final run of assistant messages."""
    end = len(messages)
    while end and messages[end - 1]["role"] == "assistant":
        end -= 1
    return messages[:end]


def load_pairs(cfg: PostTrainConfig, files: list[str]) -> list[PreferencePair]:
    """Every pair of ``files`` (rows checked; an error names file, row and key)."""
    pairs = []
    for f in files:
        path = Path(f)
        if not path.exists():
            raise MissingPathError(f"preference data file not found: {path}")
        rows = [_row_to_pair(row, f"{path}: {where}", cfg.rm) for where, row in iter_rows(path)]
        if not rows:
            raise DataError(f"{path}: no rows found; a preference file needs at least one pair")
        pairs += rows
    return pairs


def render(tokenizer, prompt: Text | None, response: Text) -> str:
    """The text a response is scored on (as posttrain.rewards.reward_model renders it)."""
    templated = bool(getattr(tokenizer, "chat_template", None))
    if prompt is None:  # implicit prompt: the response is the whole conversation
        if isinstance(response, str):
            return response
        if not templated:
            raise DataError("chat-message pairs need a tokenizer with a chat_template; this one has none")
        return tokenizer.apply_chat_template(response, tokenize=False)
    if templated:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if isinstance(response, str):
            messages.append({"role": "assistant", "content": response})
        else:
            messages += response
        return tokenizer.apply_chat_template(messages, tokenize=False)
    if not (isinstance(prompt, str) and isinstance(response, str)):
        raise DataError("chat-message pairs need a tokenizer with a chat_template; this one has none")
    return prompt + response


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered text (a chat template holds its special tokens; plain text gets the
    tokenizer's own), as the scorer of `posttrain train` encodes it."""
    templated = bool(getattr(tokenizer, "chat_template", None))
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])


def tokenize_pairs(
    pairs: list[PreferencePair], tokenizer, max_length: int
) -> tuple[list[TokenizedPair], int]:
    """(the pairs whose both sides fit ``max_length`` tokens, how many were dropped as too long)."""
    out, dropped = [], 0
    for p in pairs:
        chosen = encode(tokenizer, render(tokenizer, p.prompt, p.chosen))
        rejected = encode(tokenizer, render(tokenizer, p.prompt, p.rejected))
        if chosen == rejected:
            raise DataError(f"{p.source}: chosen and rejected render to the same tokens; remove the row")
        if len(chosen) > max_length or len(rejected) > max_length:
            dropped += 1
            continue
        out.append(TokenizedPair(chosen, rejected, p.margin))
    return out, dropped
