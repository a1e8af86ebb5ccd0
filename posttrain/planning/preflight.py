"""Checks every command runs first (train, eval, sft, explain): what a user names must exist and import
before any model loads, so a typo costs a second, not a model load.

- the reward function imports and its signature fits one of the accepted styles; a reward that runs code
  (the built-in `code`) runs a trivial program through its harness at the configured sandbox limits
  (posttrain.planning.sandbox_probe);
- every data file named exists; files without a reward are an error for RL (the reward scores them);
- model.path is a built-in name allowed with this data, a local model directory, or a Hub id that is
  cached (or may be downloaded); explain, which plans before the model is at hand, only checks the first;
- the optional packages the configured loggers need are installed;
- train, explain and eval: the multi-turn settings (posttrain.agents.check: tool config, environment, env.kwargs,
  combinations multi-turn rollouts do not support) and the harness (posttrain.gateway.harness: it imports, or its
  program is found);
- train and explain: every config-only check of the run (posttrain.rl.build.check_config) and the first rows
  of each data file, so explain accepts exactly what train accepts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from posttrain.agents.check import check_multi_turn
from posttrain.config.errors import ConfigError, MissingPathError
from posttrain.config.schema import PostTrainConfig
from posttrain.data.datasets import first_records
from posttrain.gateway.harness import check_harness
from posttrain.models.hf import read_model_config
from posttrain.models.hub import looks_like_hub_id, resolve_hub_model
from posttrain.models.model_path import check_builtin_choice
from posttrain.parallel.runtime import select_device
from posttrain.planning.input_checks import check_inputs
from posttrain.rewards.process_reward import check_prm_dir
from posttrain.rewards.reward_model import check_reward_model_dir
from posttrain.rl.build import check_config
from posttrain.rm.command import check_ranks, read_pairs
from posttrain.rm.command import model_config as rm_model_config
from posttrain.rm.prm_command import check_prm_setup, read_stepwise
from posttrain.train.checkpoint_index import check_resume_setting

# logger -> (module it imports, extra that installs it)
_LOGGER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def preflight(
    cfg: PostTrainConfig,
    command: str,
    model_override: str | None = None,
    world_size: int = 1,
    check_model: bool = True,
    ranks_elsewhere: bool = False,
    inputs_checked: bool = False,
) -> None:
    """Raise a ConfigError naming the key and the fix for the first thing that cannot work.

    `posttrain train` and `posttrain explain` run the same checks here, in the same order, so explain accepts
    exactly what train accepts: the ones above, every config-only check of the run
    (posttrain.rl.build.check_config) and the first rows of each data file with the data keys train reads.

    ``model_override``: eval's --model, which replaces model.path when it is a model directory.
    ``world_size``: the ranks the run has (explain: the ones it plans for). ``check_model``: False for explain
    given --model-config (the model need not be here: only its shape is used). ``ranks_elsewhere``: Ray
    places the ranks on other machines (trainer.ray_ranks), so this one need not have their GPU.
    ``inputs_checked``: the command line ran :func:`~posttrain.planning.input_checks.check_inputs` already,
    before it imported this module (and torch).
    """
    if not inputs_checked:
        check_inputs(cfg, command)
    if command in ("train", "explain", "eval"):
        check_multi_turn(cfg)
        check_harness(cfg)
    if not check_model:
        check_builtin_choice(cfg)  # a built-in model that cannot be used with this data is still an error
    elif model_override and (Path(model_override) / "config.json").exists():
        read_model_config(model_override, "--model")  # eval's model: a config.json that reads
    else:
        check_model_path(cfg)
    if cfg.reward.model.enable:
        check_reward_model_dir(cfg.reward.model.path)
    if cfg.reward.prm.enable:
        check_prm_dir(cfg.reward.prm.path)
    if command in ("train", "explain"):
        check_loggers(cfg.trainer.loggers)
        elsewhere = ranks_elsewhere and cfg.trainer.device == "cuda"
        check_config(cfg, world_size, torch.device("cuda") if elsewhere else select_device(cfg))
        _check_data_keys(cfg)


def preflight_rm(cfg: PostTrainConfig, world_size: int = 1, check_model: bool = True) -> None:
    """What `posttrain rm` and `posttrain explain rm` both check before any model loads, in this order: every
    pair of the data files, the data-parallel ranks, trainer.resume, the loggers' packages, model.path
    (builtin:tiny allowed: the pairs are not its task). ``check_model``: False for explain --model-config."""
    if cfg.rm.kind == "prm":  # stepwise rows, one process
        read_stepwise(cfg)
        check_prm_setup(cfg, world_size)
    else:
        read_pairs(cfg)
    check_ranks(cfg, world_size)
    check_resume_setting(cfg.trainer.run_dir, cfg.trainer.resume)
    check_loggers(cfg.trainer.loggers)
    if check_model:
        check_model_path(rm_model_config(cfg))


def _check_data_keys(cfg: PostTrainConfig) -> None:
    """The first rows of each prompt file, read with data.prompt_key / data.answer_key as train reads them."""
    d = cfg.data
    if d.task == "gsm8k":
        return  # GSM8K files have fixed fields, checked when they load
    for f in [*d.train_files, *d.val_files]:
        first_records(f, d.prompt_key, d.answer_key)


def check_model_path(cfg: PostTrainConfig) -> None:
    """model.path exists (without loading or downloading anything)."""
    path = cfg.model.path
    if path.startswith("builtin:"):
        check_builtin_choice(cfg)
    elif not Path(path).exists() and looks_like_hub_id(path):
        resolve_hub_model(path, download=False)  # raises when offline and not cached
    elif not (Path(path) / "config.json").exists():
        raise MissingPathError(
            f"model.path={path!r} is not a Hugging Face model directory (no config.json) nor a Hub id "
            "('org/name'); give a local directory saved with save_pretrained, a Hub id, model.path=builtin:base "
            "(the untrained tiny model) or builtin:tiny (the arithmetic demo)"
        )
    else:
        read_model_config(
            path, "model.path"
        )  # a config.json that reads, with a model_type transformers knows


def check_loggers(loggers: list[str]) -> None:
    """A configured logger whose package is missing fails now, with the install command, not at step 1."""
    for name in loggers:
        if name not in _LOGGER_PACKAGES:
            continue
        module, extra = _LOGGER_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"trainer.loggers includes {name!r} but the {module} package is not installed: "
                f'pip install "posttrain[{extra}]" (from a source checkout: pip install -e ".[{extra}]"), '
                f"or remove {name!r} from trainer.loggers (e.g. trainer.loggers=[console,jsonl])"
            )
