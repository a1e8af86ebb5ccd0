"""The first checks of every command, without torch: the files a config names exist, the reward function
imports and has the right signature, the task's options and env.kwargs fit the task. They need no model and no
heavy library, so the command line runs them before it imports the rest: a misspelled file or function name
fails at once. :func:`posttrain.planning.preflight.preflight` runs them first, then the checks that need more."""

from __future__ import annotations

from pathlib import Path

from posttrain.config.errors import ConfigError, MissingPathError
from posttrain.config.schema import PostTrainConfig
from posttrain.data.splits import load_splits, task_arguments
from posttrain.data.tasks import get_task, load_task
from posttrain.planning.sandbox_probe import check_code_sandbox
from posttrain.rewards.code import SANDBOX_REWARDS
from posttrain.rewards.functions import resolve_reward_function


def check_inputs(cfg: PostTrainConfig, command: str) -> None:
    """The torch-free checks of ``command`` (train, eval, sft, explain), in the order preflight runs them."""
    _check_data_files(cfg, command)
    _check_reward(cfg, command)
    _check_task_options(cfg)
    _check_env_kwargs_against_task(cfg)


def _check_data_files(cfg: PostTrainConfig, command: str) -> None:
    named = [("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)]
    if command == "sft":
        named += [("sft.train_files", cfg.sft.train_files), ("sft.val_files", cfg.sft.val_files)]
    for key, files in named:
        for f in files:
            if not Path(f).exists():
                raise MissingPathError(f"{key}: file {f!r} not found (relative paths start at {Path.cwd()})")
    if (
        command == "sft"
        and (cfg.data.val_files or cfg.sft.val_files)
        and not (cfg.sft.train_files or cfg.data.train_files)
    ):
        raise ConfigError(
            "validation files are set but there is nothing to fine-tune on: set sft.train_files=[...] "
            "(prompt and response per row) or data.train_files=[...] (their answers become the responses)"
        )
    if command == "train" and cfg.data.val_files and not cfg.data.train_files:
        raise ConfigError(
            "data.val_files is set but data.train_files is empty: training needs prompts to train on; set "
            "data.train_files=[...] (or use `posttrain eval` to evaluate the validation files alone)"
        )


def _check_reward(cfg: PostTrainConfig, command: str) -> None:
    """Import the reward and check its signature, as the run will (build_components, eval, SFT's accuracy)."""
    spec = cfg.reward.function
    user_files = cfg.data.train_files or cfg.data.val_files
    if not spec and cfg.data.task == "gsm8k":
        spec = "gsm8k"
    if not spec and user_files and command != "sft":
        spec = load_splits(cfg).reward_spec  # rows with a data_source pick built-in scorers; else a DataError
    if not spec and not user_files:
        spec = get_task(cfg.data.task).default_reward
    if spec and spec not in SANDBOX_REWARDS:
        resolve_reward_function(spec)
    if spec in SANDBOX_REWARDS:  # the harness runs at the configured limits, as the reward will
        check_code_sandbox(cfg.sandbox)


def _check_task_options(cfg: PostTrainConfig) -> None:
    """data.task_options fit the built-in task: generate one question of each split with them (cheap)."""
    d = cfg.data
    if d.task_options and not (d.train_files or d.val_files) and d.task != "gsm8k":
        load_task(d.task, cfg.trainer.seed, n_train=1, n_val=1, **task_arguments(cfg))


def _check_env_kwargs_against_task(cfg: PostTrainConfig) -> None:
    """env.kwargs a built-in multi-turn task's rows override are refused: the rows of data.task=guess_number
    carry low, high and max_turns, which its environment takes over its constructor's (env.kwargs.high=abc,
    low=50 high=10 and max_turns=1 were silently ignored)."""
    d, kwargs = cfg.data, cfg.env.kwargs
    if not kwargs or d.train_files or d.val_files or d.task == "gsm8k":
        return
    task = get_task(d.task)
    if not task.environment or cfg.env.path not in ("", task.environment):
        return
    rows, _ = load_task(d.task, cfg.trainer.seed, n_train=1, n_val=1, **task_arguments(cfg))
    overridden = [k for k in kwargs if k in rows[0].extra]
    if overridden:
        key = overridden[0]
        raise ConfigError(
            f"env.kwargs.{key}={kwargs[key]!r} has no effect with data.task={d.task}: every row of the task sets "
            f"{', '.join(overridden)} for its environment, over env.kwargs; set "
            f"data.task_options.{key}=VALUE instead (the task checks it), and drop env.kwargs.{key}"
        )
