"""Demonstration conversations of the built-in agentic tasks, for the SFT warm start (`posttrain sft`).

Each demonstration is a row ``{"messages": [...]}`` in the chat format the rollout produces: the assistant's tool
calls are hermes ``<tool_call>`` text (what the model samples), tool results are ``tool`` messages and hints are
``user`` messages. `posttrain sft` trains on the assistant messages only (posttrain.sft.conversation).

The demonstrations are imperfect on purpose, as written data often is: ``calculator`` and ``python_arithmetic``
answer from memory (a wrong number) in a share of them, ``guess_number`` guesses at random inside the interval in a share of its turns. The
warm-started policy then knows the format and the good play but does not prefer it enough; RL with the task's
reward has something to learn (docs/agents.md, "Built-in tasks").
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from posttrain.agents.builtin_envs import calculator
from posttrain.agents.hermes import tool_call_text
from posttrain.config.errors import DataError
from posttrain.data.records import PromptRecord
from posttrain.data.tasks import python_arithmetic

#: Defaults of the imperfection: share of calculator and python_arithmetic demonstrations without the tool, and of
#: guess_number turns that guess at random in the interval instead of its middle.
NO_TOOL_RATE = 0.5
RANDOM_GUESS_RATE = 0.5


def _wrong_guess(product: int, rng: random.Random) -> int:
    """A plausible mental answer: the product with one or two of its digits after the first changed (a
    one-digit product, e.g. of 1-digit operands, has its only digit changed)."""
    digits = list(str(product))
    first = 1 if len(digits) > 1 else 0
    for _ in range(rng.randint(1, 2)):
        i = rng.randrange(first, len(digits))
        digits[i] = str((int(digits[i]) + rng.randint(1, 9)) % 10)
    guess = int("".join(digits))
    return guess if guess != product else product + 1


def calculator_demonstration(
    record: PromptRecord, rng: random.Random, no_tool_rate: float = NO_TOOL_RATE
) -> dict:
    """The question, a tool call, its result and the answer; with probability ``no_tool_rate`` a wrong answer
    from memory instead."""
    a, b = record.extra["a"], record.extra["b"]
    user = {"role": "user", "content": record.prompt}
    if rng.random() < no_tool_rate:
        return {"messages": [user, {"role": "assistant", "content": str(_wrong_guess(a * b, rng))}]}
    expression = f"{a} * {b}"
    result = calculator(expression)
    call = {"role": "assistant", "content": tool_call_text("calculator", {"expression": expression})}
    return {
        "messages": [
            user,
            call,
            {"role": "tool", "content": result},
            {"role": "assistant", "content": result},
        ]
    }


def python_arithmetic_demonstration(
    record: PromptRecord, rng: random.Random, no_tool_rate: float = NO_TOOL_RATE
) -> dict:
    """The task's solved conversation (a python call printing the product, the sandbox's output, the answer);
    with probability ``no_tool_rate`` a wrong answer from memory instead."""
    a, b = record.extra["a"], record.extra["b"]
    if rng.random() < no_tool_rate:
        answer = {"role": "assistant", "content": str(_wrong_guess(a * b, rng))}
        return {"messages": [{"role": "user", "content": record.prompt}, answer]}
    return {"messages": python_arithmetic.demonstration(a, b)}


def guess_number_demonstration(
    record: PromptRecord, rng: random.Random, random_guess_rate: float = RANDOM_GUESS_RATE
) -> dict:
    """A game against the row's target: each guess is the interval's middle, or with probability
    ``random_guess_rate`` any number of the interval; it ends at the target or at the turn limit."""
    extra = record.extra
    low, high, target, turns = extra["low"], extra["high"], extra["target"], extra["max_turns"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": record.prompt}]
    for turn in range(turns):
        guess = rng.randint(low, high) if rng.random() < random_guess_rate else (low + high) // 2
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == target or turn == turns - 1:
            break
        if guess < target:
            low = guess + 1
            messages.append({"role": "user", "content": "Higher."})
        else:
            high = guess - 1
            messages.append({"role": "user", "content": "Lower."})
    return {"messages": messages}


DEMONSTRATIONS = {
    "calculator": calculator_demonstration,
    "guess_number": guess_number_demonstration,
    "python_arithmetic": python_arithmetic_demonstration,
}
#: The keyword of each task's imperfection (make_demos.py --rate).
RATE_KEYWORD = {
    "calculator": "no_tool_rate",
    "guess_number": "random_guess_rate",
    "python_arithmetic": "no_tool_rate",
}


def demonstrations(
    task: str, records: list[PromptRecord], n: int, seed: int, rate: float | None = None
) -> list:
    """``n`` demonstration rows drawn over ``records`` (cycled in order; ``rate``: the task's imperfection)."""
    if task not in DEMONSTRATIONS:
        raise DataError(f"no demonstrations for task {task!r}; there are for {sorted(DEMONSTRATIONS)}")
    make = DEMONSTRATIONS[task]
    rng = random.Random(seed)
    extra = {} if rate is None else {RATE_KEYWORD[task]: rate}
    return [make(records[i % len(records)], rng, **extra) for i in range(n)]


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
