"""``check_multi_turn(cfg)``: every multi-turn setting that cannot work is a ConfigError before any model loads.

`posttrain train`, `explain` and `eval` run it from their preflight checks. It loads the tool config (each tool
imported, each explicit schema checked against its function), resolves `env.path` and binds `env.kwargs` to the
environment's constructor, and rejects the combinations multi-turn rollouts do not support.
"""

from __future__ import annotations

import importlib.util

from posttrain.agents.build import SKYRL, check_env_kwargs, environment_factory, load_tools, resolve_env
from posttrain.agents.env import Environment
from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.sandbox.build import RunSandbox


def check_multi_turn(cfg: PostTrainConfig) -> None:
    """Raise a ConfigError (key, value, rule, fix) for the first multi-turn setting that cannot work."""
    mt, env = cfg.rollout.multi_turn, cfg.env
    if not mt.enable:
        _check_disabled(cfg)
        return
    _check_combinations(cfg)
    tools = load_tools(cfg)
    spec = resolve_env(env.path)
    check_env_kwargs(spec, env.kwargs)
    if spec.kind == SKYRL:
        if len(tools):
            raise ConfigError(
                f"rollout.multi_turn.tool_config_path={mt.tool_config_path!r} with env.path={env.path!r}: SkyRL "
                "environments run their own tools; drop the tool config"
            )
        if importlib.util.find_spec("skyrl_gym") is None:
            raise ConfigError(
                f"env.path={env.path!r} needs the skyrl-gym package, which is not installed: "
                "pip install 'posttrain[skyrl]'"
            )
        _check_skyrl_class(spec.skyrl_class, env.path)
        return
    sample_environment(cfg).close()


def sample_environment(cfg: PostTrainConfig, sandbox: RunSandbox | None = None) -> Environment:
    """One environment made as the run will make them (an empty row; SkyRL's are made at reset): its constructor
    runs with `env.kwargs`, and a failure there is a ConfigError naming the keys. ``sandbox``: the run's."""
    make_env = environment_factory(cfg, sandbox)
    try:
        return make_env({})
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"env.path={cfg.env.path!r} with env.kwargs={cfg.env.kwargs!r}: making the environment failed: "
            f"{exc!r}; fix env.kwargs (or the environment's constructor)"
        ) from exc


def _check_disabled(cfg: PostTrainConfig) -> None:
    mt, env = cfg.rollout.multi_turn, cfg.env
    set_keys = [
        f"{key}={value!r}"
        for key, value in (
            ("env.path", env.path),
            ("env.kwargs", env.kwargs),
            ("rollout.multi_turn.tool_config_path", mt.tool_config_path),
        )
        if value
    ]
    if set_keys:
        raise ConfigError(
            f"{', '.join(set_keys)} configure(s) multi-turn rollouts, but rollout.multi_turn.enable=false: they "
            "would be ignored; set rollout.multi_turn.enable=true, or drop those keys"
        )


def _check_combinations(cfg: PostTrainConfig) -> None:
    """Settings that work single-turn but not with multi-turn trajectories."""
    mt = cfg.rollout.multi_turn
    if cfg.algorithm.adv_estimator == "remax":
        raise ConfigError(
            "algorithm.adv_estimator=remax with rollout.multi_turn.enable=true: ReMax's baseline is one greedy "
            "single-turn response per prompt, which a multi-turn trajectory has no counterpart for; use grpo "
            "(or rloo, gae) with multi-turn rollouts, or set rollout.multi_turn.enable=false"
        )
    if cfg.async_training.partial_rollout:
        raise ConfigError(
            "async_training.partial_rollout=true with rollout.multi_turn.enable=true: a partial rollout is "
            "continued as plain tokens, which would lose the trajectory's turns and the mask that keeps "
            "environment tokens out of the loss; set async_training.partial_rollout=false (async_training.enable "
            "alone keeps rollouts ahead of training)"
        )
    limit = cfg.data.max_response_length
    if mt.max_tokens_per_turn > limit:
        raise ConfigError(
            f"rollout.multi_turn.max_tokens_per_turn={mt.max_tokens_per_turn} is more than "
            f"data.max_response_length={limit}, the token budget of the whole trajectory (every assistant turn "
            f"and environment reply together), so one turn could never reach it; set "
            f"rollout.multi_turn.max_tokens_per_turn <= {limit} (or 0: only the trajectory budget)"
        )


def _check_skyrl_class(env_class: str | None, path: str) -> None:
    if env_class is None:
        return  # each row names its env_class; checked when the row's environment is made
    import skyrl_gym  # optional extra, present (checked above)

    registry = getattr(getattr(skyrl_gym, "envs", None), "registration", None)
    known = sorted(getattr(registry, "registry", {}) or {})
    if known and env_class not in known:
        raise ConfigError(
            f"env.path={path!r}: skyrl-gym has no environment {env_class!r}; registered: {known}"
        )
