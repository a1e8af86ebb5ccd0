"""Built-in agentic task `calculator`: "What is 52 * 67?", a product the tiny built-in model cannot work out in its
head (its SFT warm start answered 0 of 278 held-out 2-digit products right without the tool; docs/agents.md).

The operands have 2 digits by default (``min_digits``/``max_digits`` change that): with 3 or 4 digits the tiny
model's warm start did not learn to copy the operands into the tool call, so GRPO had no signal.

The run plays it in the built-in ``calculator`` environment (:class:`posttrain.agents.builtin_envs.CalculatorEnv`): the
model may write a ``<tool_call>`` for the safe ``calculator`` tool, reads the result in a tool message and then
answers. The reward is 1.0 when the first number of the final assistant message equals the product; the share of
trajectories that call the tool is a metric (``tools/call_frequency``).

Demonstrations for the SFT warm start are written by ``posttrain.agents.demos``.
"""

from __future__ import annotations

import random
from typing import Any

from posttrain.config.errors import DataError
from posttrain.data.records import PromptRecord
from posttrain.data.tasks.arithmetic import first_number

TOOL_RESPONSE_END = "</tool_response>"


def calculator_prompt(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def make_calculator_splits(
    seed: int, n_train: int, n_val: int, min_digits: int = 2, max_digits: int = 2
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Disjoint train and held-out products of two ``min_digits``..``max_digits``-digit numbers (seeded)."""
    records = [_record(a, b) for a, b in product_pairs(seed, n_train, n_val, min_digits, max_digits)]
    return records[:n_train], records[n_train:]


def product_pairs(
    seed: int, n_train: int, n_val: int, min_digits: int, max_digits: int
) -> list[tuple[int, int]]:
    """``n_train + n_val`` distinct (a, b) pairs of ``min_digits``..``max_digits``-digit numbers, drawn with
    ``seed`` (the first ``n_train`` for training: no problem is in both splits)."""
    if not 1 <= min_digits <= max_digits:
        raise DataError(
            f"need 1 <= min_digits <= max_digits, got min_digits={min_digits}, max_digits={max_digits}"
        )
    if n_train < 1 or n_val < 0:
        raise DataError(f"need n_train >= 1 and n_val >= 0, got n_train={n_train}, n_val={n_val}")
    low, high = 10 ** (min_digits - 1), 10**max_digits - 1
    span = high - low + 1
    if n_train + n_val > span * span:
        raise DataError(f"n_train + n_val = {n_train + n_val} exceeds the {span * span} distinct problems")
    picks = random.Random(seed).sample(range(span * span), n_train + n_val)
    return [(low + i // span, low + i % span) for i in picks]


def _record(a: int, b: int) -> PromptRecord:
    return PromptRecord(
        prompt=calculator_prompt(a, b), ground_truth=str(a * b), extra={"task": "calculator", "a": a, "b": b}
    )


def load_calculator(
    seed: int,
    n_train: int = 2000,
    n_val: int = 128,
    min_digits: int = 2,
    max_digits: int = 2,
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Task-registry entry point."""
    return make_calculator_splits(seed, n_train, n_val, min_digits, max_digits)


def assistant_texts(response: str, extra: dict[str, Any]) -> list[str]:
    """The assistant messages of a trajectory: from ``extra["messages"]`` when the run passes them, else the
    response text cut at the environment's messages (tool results and hints carry no assistant text)."""
    messages = extra.get("messages")
    if isinstance(messages, list) and messages:
        return [str(m.get("content", "")) for m in messages if m.get("role") == "assistant"]
    return [response]


def final_answer(response: str, extra: dict[str, Any]) -> str:
    """The last assistant message (from the messages), else what follows the last tool result in the text."""
    texts = assistant_texts(response, extra)
    text = texts[-1] if texts else ""
    return text.rsplit(TOOL_RESPONSE_END, 1)[-1]


def calculator_reward(prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any]) -> float:
    """1.0 when the first number of the final answer equals the product ``ground_truth``, else 0.0."""
    if ground_truth is None:
        raise DataError("the calculator reward needs the product as ground_truth; the record has none")
    value = first_number(final_answer(response, extra))
    return 1.0 if value is not None and value == int(ground_truth) else 0.0
