"""Built-in task `python_arithmetic`: "What is 48213957 * 30719284?", far beyond a tiny model's head, easy for
Python.

The run plays it in the built-in ``python`` environment (:class:`posttrain.agents.python_tool.PythonEnv`): the
model may write a ``<tool_call>`` to the ``python`` tool (e.g. ``print(48213957 * 30719284)``), reads the output
in a tool message, then answers. The reward (``arithmetic``: the first number of the final assistant message
equals the product) is 1.0 only for the exact product; the share of trajectories that call the tool is in the
step metrics (``tools/call_frequency``).

The default operands (6 to 9 digits) are what the task is about; the tiny built-in model learns the task with
``data.task_options.min_digits=2 data.task_options.max_digits=2`` (it must copy the operands into the call and the
output back; benchmarks/agent_tasks.py python_arithmetic, docs/sandbox.md).
"""

from __future__ import annotations

import json

from posttrain.data.records import PromptRecord
from posttrain.data.tasks.calculator import product_pairs

INSTRUCTION = "Use the python tool to compute it exactly, then answer with the number."


def python_arithmetic_prompt(a: int, b: int) -> str:
    return f"What is {a} * {b}? {INSTRUCTION}"


def demonstration(a: int, b: int) -> list[dict[str, str]]:
    """The messages of a solved problem (for an SFT warm start): a python call printing the product, the tool's
    output, and the answer."""
    call = json.dumps({"name": "python", "arguments": {"code": f"print({a} * {b})"}})
    call = f"<tool_call>\n{call}\n</tool_call>"  # the hermes block (agents.hermes.tool_call_text)
    return [
        {"role": "user", "content": python_arithmetic_prompt(a, b)},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]


def make_python_arithmetic_splits(
    seed: int, n_train: int, n_val: int, min_digits: int = 6, max_digits: int = 9
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Disjoint train and held-out products of two ``min_digits``..``max_digits``-digit numbers (seeded)."""
    records = [_record(a, b) for a, b in product_pairs(seed, n_train, n_val, min_digits, max_digits)]
    return records[:n_train], records[n_train:]


def _record(a: int, b: int) -> PromptRecord:
    return PromptRecord(
        prompt=python_arithmetic_prompt(a, b),
        ground_truth=str(a * b),
        extra={"task": "python_arithmetic", "a": a, "b": b},
    )


def load_python_arithmetic(
    seed: int,
    n_train: int = 2000,
    n_val: int = 128,
    min_digits: int = 6,
    max_digits: int = 9,
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Task-registry entry point."""
    return make_python_arithmetic_splits(seed, n_train, n_val, min_digits, max_digits)
