"""The environment factory of a run: `env.*` and `rollout.multi_turn.*` read here, in one place.

``environment_factory(cfg)`` returns ``make_env(row) -> Environment``: one fresh environment per trajectory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.agents.builtin import GuessNumberEnv
from posttrain.agents.env import Environment, ToolEnvironment
from posttrain.agents.tool_config import load_tool_config
from posttrain.agents.tools import ToolSet
from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.utils.user_code import function_of, import_file

EnvFactory = Callable[[dict[str, Any]], Environment]


def builtin_environments() -> dict[str, type]:
    """The environments named by a bare word in `env.path`."""
    return {"guess_number": GuessNumberEnv}


def environment_factory(cfg: PostTrainConfig) -> EnvFactory:
    """``make_env(row)`` for this run's multi-turn rollouts (see the module docstring)."""
    mt, env = cfg.rollout.multi_turn, cfg.env
    tools = load_tool_config(mt.tool_config_path) if mt.tool_config_path else ToolSet([])
    if not env.path:
        return lambda row: ToolEnvironment(tools, mt.max_parallel_calls, mt.tool_timeout_s)
    builtin = builtin_environments()
    if env.path in builtin:
        cls = builtin[env.path]
    else:
        cls = _class_from_path(env.path)
    kwargs = dict(env.kwargs)
    return lambda row: cls(**kwargs)


def _class_from_path(spec: str) -> type:
    file, sep, name = spec.rpartition(":")
    if not sep or not file or not name:
        raise ConfigError(
            f"env.path={spec!r} must be a built-in name ({', '.join(builtin_environments())}) or "
            "'path/to/file.py:ClassName'"
        )
    module = import_file(Path(file), "env.path")
    return function_of(module, name, "env.path", what="classes")
