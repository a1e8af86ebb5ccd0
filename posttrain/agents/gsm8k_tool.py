"""The GSM8K answer-check tool: the model submits its answer and is told whether it is right.

posttrain's own counterpart of verl's ``Gsm8kTool`` (the ``calc_gsm8k_reward`` tool of verl's
``gsm8k_tool_config.yaml``, which a tool config may name by verl's class name): the answer's last number is compared
with the row's ground truth, as the ``gsm8k_flexible`` reward reads a response ("1,200" equals "1200"). The tool
message says what was read and the score; the trajectory's reward stays the run's reward function's.

The check needs the row: :func:`bind_row` gives each trajectory's environment the tool bound to its row's
``ground_truth`` (verl's ``reward_model.ground_truth``). A name and signature are all :func:`calc_gsm8k_reward`
itself holds, for the schema.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from posttrain.agents.tools import ToolSet
from posttrain.data.scorers import gsm8k_flexible


def calc_gsm8k_reward(answer: str) -> str:
    """Check your answer to the GSM8K problem: reward 1.0 if it is correct, 0.0 if not.

    Args:
        answer: your final answer, a number.
    """
    raise RuntimeError(
        "the GSM8K check needs the row's answer: bind it with posttrain.agents.gsm8k_tool.bind_row"
    )


class _BoundCheck:
    """The check against one row's ground truth (a class, not a closure: it names itself in errors and pickles)."""

    __name__ = "calc_gsm8k_reward"

    def __init__(self, ground_truth: str | None) -> None:
        self.ground_truth = ground_truth

    def __call__(self, answer: str) -> str:
        if self.ground_truth is None:
            raise ValueError(
                "this row has no ground truth (reward_model.ground_truth) to check the answer with"
            )
        score = gsm8k_flexible("", str(answer), self.ground_truth, {})
        return f"answer {str(answer)!r} read; reward {score}"


def bind_row(tools: ToolSet, row: dict[str, Any]) -> ToolSet:
    """``tools`` with the GSM8K check (if it is one of them) bound to ``row``'s ground truth."""
    if not any(t.fn is calc_gsm8k_reward for t in tools.tools.values()):
        return tools
    check = _BoundCheck(row.get("ground_truth"))
    return ToolSet([replace(t, fn=check) if t.fn is calc_gsm8k_reward else t for t in tools.tools.values()])
