"""A run's training and validation records and the reward they are scored with: the user's files, GSM8K-format
files, or the generated built-in task."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

from posttrain.config.errors import ConfigError, DataError
from posttrain.config.schema import PostTrainConfig
from posttrain.data.datasets import load_records
from posttrain.data.records import PromptRecord
from posttrain.data.scorers import CODE_SOURCES, check_data_sources
from posttrain.data.tasks import get_task, load_task
from posttrain.data.tasks.gsm8k import load_gsm8k


@dataclass(frozen=True)
class Splits:
    train: list[PromptRecord]
    val: list[PromptRecord]
    reward_spec: str  # a built-in reward name or 'file.py:fn'
    data_source: str = ""  # what a verl-style reward gets as data_source: the task or the first file's name


def load_splits(cfg: PostTrainConfig) -> Splits:
    """Training and validation records: GSM8K-format files (data.task=gsm8k), other prompt files
    (data.train_files and/or data.val_files with a reward.function), or the generated arithmetic task.

    data.val_files without data.train_files gives no training records: `posttrain eval` evaluates the given
    files (the built-in task is generated only when no files are given at all)."""
    d = cfg.data
    reward = cfg.reward.function
    if d.task == "gsm8k":
        if not d.train_files:
            raise DataError(
                "data.task=gsm8k reads your own GSM8K-format files (question, answer ending in '#### 42'): "
                "set data.train_files=[train.jsonl] (and data.val_files=[test.jsonl])"
            )
        train = [r for f in d.train_files for r in load_gsm8k(f)]
        val = [r for f in d.val_files for r in load_gsm8k(f)]
        return Splits(train, val, reward or "gsm8k", "gsm8k")
    if d.train_files or d.val_files:
        train = [r for f in d.train_files for r in load_records(f, d.prompt_key, d.answer_key)]
        val = [r for f in d.val_files for r in load_records(f, d.prompt_key, d.answer_key)]
        if not reward:
            reward = _reward_by_data_source(train + val)
        first = (d.train_files or d.val_files)[0]
        return Splits(train, val, reward, Path(first).stem)
    train, val = load_task(
        d.task,
        cfg.trainer.seed,
        n_train=d.num_train_examples,
        n_val=d.num_val_examples,
        **task_arguments(cfg),
    )
    return Splits(train, val, reward or get_task(d.task).default_reward, d.task)


def task_options(cfg: PostTrainConfig) -> dict:
    """``data.task_options``, refusing the entries that have keys of their own (sizes, arithmetic's operand)."""
    options = dict(cfg.data.task_options)
    owned = {"n_train": "num_train_examples", "n_val": "num_val_examples", "max_operand": "max_operand"}
    for name, key in owned.items():
        if name in options:
            raise ConfigError(
                f"config key 'data.task_options.{name}' = {options[name]!r}: the task's {name} is set by "
                f"data.{key}; set data.{key}={options[name]} instead"
            )
    return options


def task_arguments(cfg: PostTrainConfig) -> dict:
    """The built-in task's options (:func:`task_options`), plus ``data.max_operand`` for a task whose loader
    takes it (the arithmetic task; the other tasks have no operand bound)."""
    options = task_options(cfg)
    if "max_operand" in inspect.signature(get_task(cfg.data.task).load).parameters:
        options["max_operand"] = cfg.data.max_operand
    return options


def _reward_by_data_source(records: list[PromptRecord]) -> str:
    """'data_source' ('data_source_code' when some rows are code) (each row scored by the built-in scorer for its data_source, as verl's default scorer
    does) when every record has one and a scorer exists for each; else a DataError/ConfigError."""
    sources = [r.extra.get("data_source") for r in records]
    if not records or not all(isinstance(s, str) for s in sources):
        raise DataError(
            "reward.function is empty but data files are given: name a reward, e.g. "
            "reward.function=exact_match, reward.function=gsm8k or reward.function=path/to/file.py:fn "
            "(rows with a data_source field, as verl writes them, pick a built-in scorer by it)"
        )
    check_data_sources(sources, "the data")  # type: ignore[arg-type]
    # Code sources run in the sandbox, which is then built (and checked) at start-up.
    return "data_source_code" if any(s in CODE_SOURCES for s in sources) else "data_source"
