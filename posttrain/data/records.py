"""The unit of prompt data every task and loader produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: A chat prompt: ``[{"role": "user", "content": "..."}, ...]``.
ChatMessages = list[dict[str, str]]


@dataclass(frozen=True)
class PromptRecord:
    """One prompt with its reference answer.

    Attributes:
        prompt: plain text, or a list of chat messages (``{"role", "content"}`` dicts).
        ground_truth: the reference answer a rule reward compares against; None when the task has none
            (e.g. when a reward model scores responses).
        extra: every other field of the source row, passed unchanged to the reward function.
        source: where the row came from (``"train.jsonl: row 3 (line 4)"``), for error messages; empty for
            generated tasks. Not part of equality: the same prompt from two files is the same record.
    """

    prompt: str | ChatMessages
    ground_truth: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    source: str = field(default="", compare=False)
