"""Built-in tasks: each turns options into train/validation records and names its default reward.

Usage::

    task = get_task("arithmetic")
    train, val = task.load(seed=0, n_train=1000, n_val=100)
    reward_fn = resolve_reward_function(task.default_reward)  # from posttrain.rewards
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from posttrain.config.errors import DataError
from posttrain.data.records import PromptRecord
from posttrain.data.tasks.arithmetic import load_arithmetic, make_arithmetic_splits
from posttrain.data.tasks.calculator import calculator_reward, load_calculator
from posttrain.data.tasks.gsm8k import load_gsm8k, load_gsm8k_task
from posttrain.data.tasks.guess_number import environment_reward, load_guess_number
from posttrain.data.tasks.python_arithmetic import load_python_arithmetic
from posttrain.data.tasks.reasoning_gym import PREFIX as REASONING_GYM
from posttrain.data.tasks.reasoning_gym import load_reasoning_gym

#: ``load(seed, **options) -> (train_records, val_records)``.
TaskLoader = Callable[..., tuple[list[PromptRecord], list[PromptRecord]]]


@dataclass(frozen=True)
class Task:
    """A built-in task.

    Attributes:
        name: the registry key.
        load: ``load(seed, **options) -> (train_records, val_records)``; options are task specific.
        default_reward: name of its reward in ``posttrain.rewards.REWARD_FUNCTIONS``.
        description: one line for help texts.
        environment: for a multi-turn task, the `env.path` it is played in (a built-in environment name): the
            run then rolls out multi-turn trajectories in it unless `env.path` names another. Empty: single-turn.
    """

    name: str
    load: TaskLoader
    default_reward: str
    description: str
    environment: str = ""


TASKS: dict[str, Task] = {
    "arithmetic": Task(
        name="arithmetic",
        load=load_arithmetic,
        default_reward="arithmetic",
        description="'What is 23 + 58?' generated from the seed; options n_train, n_val, min_digits, "
        "max_digits, ops, allow_negative",
    ),
    "gsm8k": Task(
        name="gsm8k",
        load=load_gsm8k_task,
        default_reward="gsm8k",
        description="GSM8K-format files of your own; options train_path, val_path, instruction",
    ),
    "calculator": Task(
        name="calculator",
        load=load_calculator,
        default_reward="calculator",
        description="multi-turn: 'What is 52 * 67?' with a calculator tool; options n_train, n_val, "
        "min_digits, max_digits (default 2 and 2)",
        environment="calculator",
    ),
    "guess_number": Task(
        name="guess_number",
        load=load_guess_number,
        default_reward="environment",
        description="multi-turn: find a hidden number from higher/lower hints within the turn limit; options "
        "n_train, n_val, low, high, max_turns",
        environment="guess_number",
    ),
    "python_arithmetic": Task(
        name="python_arithmetic",
        load=load_python_arithmetic,
        default_reward="arithmetic",
        description="multi-turn: 'What is 48213957 * 30719284?' with the python tool (sandboxed); options "
        "n_train, n_val, min_digits, max_digits",
        environment="python",
    ),
}


def get_task(name: str) -> Task:
    """The task registered as ``name``; ``reasoning_gym:<task>`` is reasoning-gym's generated task."""
    if name.startswith(REASONING_GYM):
        return Task(
            name=name,
            load=functools.partial(load_reasoning_gym, name[len(REASONING_GYM) :]),
            default_reward="reasoning_gym",
            description="reasoning-gym's generated task; options n_train, n_val and the fields of the task's own "
            "config (e.g. min_value, max_value)",
        )
    if name not in TASKS:
        raise DataError(
            f"unknown task {name!r}; built-in tasks are {sorted(TASKS)} and reasoning_gym:<name> "
            "(pip install 'posttrain[reasoning-gym]')"
        )
    return TASKS[name]


def load_task(name: str, seed: int, **options: Any) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """``get_task(name).load(seed, **options)`` with an error naming unknown options."""
    task = get_task(name)
    parameters = inspect.signature(task.load).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return task.load(seed, **options)  # the task checks its own options (reasoning-gym: its config class)
    unknown = sorted(set(options) - set(parameters) - {"seed"})
    if unknown:
        valid = [p for p in parameters if p != "seed"]
        raise DataError(
            f"config key 'data.task_options.{unknown[0]}': task {name!r} has no option(s) {unknown}; "
            f"its options are {valid}"
        )
    return task.load(seed, **options)


__all__ = [
    "TASKS",
    "Task",
    "calculator_reward",
    "environment_reward",
    "get_task",
    "load_arithmetic",
    "load_gsm8k",
    "load_gsm8k_task",
    "load_task",
    "make_arithmetic_splits",
]
