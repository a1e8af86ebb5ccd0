"""Built-in agentic task `guess_number`: find a hidden whole number from "Higher." / "Lower." hints.

The run plays it in the built-in ``guess_number`` environment (:class:`posttrain.agents.builtin_envs.GuessNumberEnv`).
Each row carries its ``target`` (and the range and turn limit) in ``extra``, so the samples of one GRPO group play
the same game. The reward is the environment's: 1.0 when a guess hits the target within ``max_turns`` guesses
(the task's reward function, ``environment``, adds nothing to it). Success depends on using the hints across
turns (bisection finds any of 2**max_turns - 1 numbers in time; blind guessing seldom does). The default game,
1 to 7 in 3 guesses, is small enough that GRPO visibly learns it on a CPU in minutes (docs/agents.md, "Built-in
tasks"); ``high=31, max_turns=5`` is a harder one.
Demonstrations for the SFT warm start are written by ``posttrain.agents.demos``.
"""

from __future__ import annotations

import random
from typing import Any

from posttrain.config.errors import DataError
from posttrain.data.records import PromptRecord


def guess_number_rules(low: int, high: int, max_turns: int) -> str:
    return (
        f"I am thinking of a whole number from {low} to {high}. Guess it in at most {max_turns} tries: answer "
        "with one number, and I will say higher or lower."
    )


def load_guess_number(
    seed: int,
    n_train: int = 512,
    n_val: int = 128,
    low: int = 1,
    high: int = 7,
    max_turns: int = 3,
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Rows of one game each, the target drawn from the seed (train and held-out targets drawn apart; with so few
    numbers both cover the range, so the held-out rate measures the policy, not memorised prompts: the prompt is
    the same for every target)."""
    for name, value in (("low", low), ("high", high), ("max_turns", max_turns)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise DataError(f"data.task_options.{name}={value!r} must be a whole number")
    if high <= low:
        raise DataError(f"need low < high, got low={low}, high={high}")
    if max_turns < 1:
        raise DataError(f"max_turns={max_turns} must be >= 1")
    if n_train < 1 or n_val < 0:
        raise DataError(f"need n_train >= 1 and n_val >= 0, got n_train={n_train}, n_val={n_val}")
    rng = random.Random(seed)
    prompt = guess_number_rules(low, high, max_turns)
    records = [
        PromptRecord(
            prompt=prompt,
            ground_truth=str(target),
            extra={
                "task": "guess_number",
                "target": target,
                "low": low,
                "high": high,
                "max_turns": max_turns,
            },
        )
        for target in (rng.randint(low, high) for _ in range(n_train + n_val))
    ]
    return records[:n_train], records[n_train:]


def environment_reward(prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any]) -> float:
    """0.0: the environment's own rewards, which a multi-turn run adds to this function's, are the whole reward
    (guess_number's environment gives 1.0 for the right guess within the turn limit)."""
    return 0.0
