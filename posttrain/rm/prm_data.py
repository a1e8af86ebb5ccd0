"""Stepwise rows for process-reward-model training (`posttrain rm` with rm.kind=prm): read, check, tokenize.

A row is TRL's stepwise format: ``{"prompt": str, "completions": [step, ...], "labels": [bool, ...]}``, one
label per step (true: the step is correct); the prompt's field is rm.prompt_key.

Tokenization follows TRL's PRM trainer exactly, so a model trained here scores steps where TRL's would:
the prompt, each step and the separator (rm.step_separator) are encoded on their own without special tokens;
the separator's tokens follow every step; the tokenizer's BOS token (when it has one) goes first; a step's
label sits on the last token of its separator, every other position is ignored (-100). Unlike TRL, a row
longer than rm.max_length is dropped and counted, never truncated (a truncated row loses its last labels).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.config.errors import DataError, MissingPathError
from posttrain.data.datasets import iter_rows
from posttrain.rewards.prm_layout import stepwise_input

IGNORED = -100  # the label of a position that is not a step's end (torch's cross-entropy ignore_index)
STEPS_KEY = "completions"  # TRL's stepwise field names
LABELS_KEY = "labels"


@dataclass(frozen=True)
class StepwiseRow:
    prompt: str
    steps: list[str]
    labels: list[bool]
    source: str  # file and row, for errors


@dataclass(frozen=True)
class TokenizedSteps:
    input_ids: list[int]
    labels: list[int]  # per token: 0/1 at each step's last separator token, IGNORED elsewhere


def _check_row(row: Any, where: str, prompt_key: str) -> StepwiseRow:
    if not isinstance(row, dict):
        raise DataError(
            f"{where}: a row must be an object with {prompt_key!r}, {STEPS_KEY!r}, {LABELS_KEY!r}"
        )
    for key in (prompt_key, STEPS_KEY, LABELS_KEY):
        if key not in row or row[key] is None:
            raise DataError(
                f"{where}: missing key {key!r}; the row has {sorted(row)}. A stepwise row needs "
                f"{prompt_key!r} (rm.prompt_key), {STEPS_KEY!r} (the steps) and {LABELS_KEY!r} (one bool per step)"
            )
    prompt, steps, labels = row[prompt_key], row[STEPS_KEY], row[LABELS_KEY]
    if not isinstance(prompt, str):
        raise DataError(
            f"{where}: {prompt_key!r} must be a string, got {type(prompt).__name__} {prompt!r:.60}"
        )
    if not isinstance(steps, list) or not steps:
        raise DataError(
            f"{where}: {STEPS_KEY!r} must be a non-empty list of step strings, got {steps!r:.60}; "
            "remove the row or give it its steps"
        )
    for i, step in enumerate(steps):
        if not isinstance(step, str) or not step.strip():
            raise DataError(
                f"{where}: {STEPS_KEY!r}[{i}] is {step!r:.60}; every step must be a non-empty string "
                "(an empty step has no tokens of its own to score)"
            )
    if not isinstance(labels, list) or len(labels) != len(steps):
        got = len(labels) if isinstance(labels, list) else type(labels).__name__
        raise DataError(
            f"{where}: {LABELS_KEY!r} has {got} entries but {STEPS_KEY!r} has {len(steps)} steps; give exactly "
            "one label per step"
        )
    for i, label in enumerate(labels):
        if not isinstance(label, bool):
            raise DataError(
                f"{where}: {LABELS_KEY!r}[{i}] is {label!r}; labels must be JSON booleans (true: the step is "
                "correct), not numbers or strings"
            )
    return StepwiseRow(prompt, list(steps), list(labels), where)


def load_stepwise(files: list[str], prompt_key: str) -> list[StepwiseRow]:
    """Every row of ``files`` (checked; an error names file, row and key)."""
    rows = []
    for f in files:
        path = Path(f)
        if not path.exists():
            raise MissingPathError(f"stepwise data file not found: {path}")
        found = [_check_row(row, f"{path}: {where}", prompt_key) for where, row in iter_rows(path)]
        if not found:
            raise DataError(f"{path}: no rows found; a stepwise file needs at least one row")
        rows += found
    return rows


def tokenize_steps(row: StepwiseRow, tokenizer, separator: str) -> TokenizedSteps:
    """The ids and per-token labels of one row, laid out as described in the module docstring."""
    input_ids, ends = stepwise_input(tokenizer, row.prompt, row.steps, separator)
    labels = [IGNORED] * len(input_ids)
    for end, label in zip(ends, row.labels):
        labels[end] = int(label)
    return TokenizedSteps(input_ids=input_ids, labels=labels)


def tokenize_stepwise(
    rows: list[StepwiseRow], tokenizer, separator: str, max_length: int
) -> tuple[list[TokenizedSteps], int]:
    """(the rows of at most ``max_length`` tokens, how many were dropped as longer)."""
    kept = [tokenize_steps(r, tokenizer, separator) for r in rows]
    fitting = [t for t in kept if len(t.input_ids) <= max_length]
    return fitting, len(kept) - len(fitting)
