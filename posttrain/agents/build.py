"""The environment factory of a run: `env.*` and `rollout.multi_turn.*` read here, in one place.

``environment_factory(cfg)`` returns ``make_env(row) -> Environment``: one fresh environment per trajectory.

`env.path` names the environment:

- empty: the tools of `rollout.multi_turn.tool_config_path` are the environment (a turn without a tool call ends
  the episode); without a tool config, plain turns (the first assistant turn ends it); a row in SkyRL's format
  (one with ``env_class``) gets that skyrl-gym environment;
- a built-in name (:func:`builtin_environments`), made with `env.kwargs`;
- ``path/to/file.py:ClassName``: a subclass of :class:`~posttrain.agents.env.Environment` (made with
  `env.kwargs`), or a TRL-style class (no ``step`` method; its public methods are the tools, ``reset(**row)``
  starts an episode), wrapped in :class:`~posttrain.agents.adapters.TRLStyleEnvironment`; or one's own skyrl-gym
  environment class (a subclass of skyrl-gym's ``BaseTextEnv``), registered with skyrl-gym under its `env.path`
  and run as ``skyrl:<env_class>`` is;
- ``skyrl`` or ``skyrl:<env_class>``: a ``skyrl-gym`` environment per row, the row's ``env_class`` first, then
  the one named here; `env.kwargs` is SkyRL's ``env_config``.

Tools and an environment together: the tool config's tools are added to a TRL-style class's methods; with an
Environment subclass (or a built-in), a turn whose tool calls all name the config's tools is answered by them and
any other turn goes to the environment (:class:`~posttrain.agents.adapters.WithTools`). SkyRL environments bring
their own tools: a tool config beside them is a ConfigError.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.agents.adapters import SkyRLEnvironment, TRLStyleEnvironment, WithTools
from posttrain.agents.builtin_envs import CalculatorEnv, GuessNumberEnv
from posttrain.agents.env import Environment, ToolEnvironment
from posttrain.agents.gsm8k_tool import bind_row
from posttrain.agents.python_tool import PythonEnv, bind_python, uses_python
from posttrain.agents.tool_config import load_tool_config
from posttrain.agents.tools import ToolSet
from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.sandbox.build import RunSandbox
from posttrain.utils.user_code import function_of, import_file

EnvFactory = Callable[[dict[str, Any]], Environment]
SKYRL = "skyrl"


def builtin_environments() -> dict[str, Callable[..., Environment]]:
    """The environments named by a bare word in `env.path` (each made with `env.kwargs`)."""
    return {"guess_number": GuessNumberEnv, "calculator": CalculatorEnv, "python": PythonEnv}


@dataclass
class EnvSpec:
    """What `env.path` resolved to: ``kind`` is none, builtin, environment, trl or skyrl."""

    kind: str
    cls: Any = None
    skyrl_class: str | None = None

    @property
    def name(self) -> str:
        if self.kind == SKYRL:
            return f"skyrl-gym environment {self.skyrl_class or '(the row env_class)'}"
        if self.cls is None:
            return "tool environment (no env.path)"
        return f"{self.cls.__module__}.{self.cls.__qualname__}"


def resolve_env(path: str) -> EnvSpec:
    """The environment `env.path` names (ConfigError naming the key, the value and the fix otherwise)."""
    if not path:
        return EnvSpec("none")
    if path == SKYRL or path.startswith(SKYRL + ":"):
        return EnvSpec(SKYRL, skyrl_class=path.partition(":")[2] or None)
    builtin = builtin_environments()
    if path in builtin:
        return EnvSpec("builtin", builtin[path])
    cls = _class_from_path(path, builtin)
    if isinstance(cls, type) and any(c.__module__.startswith("skyrl_gym.") for c in cls.__mro__[1:]):
        return EnvSpec(SKYRL, skyrl_class=_register_skyrl_class(cls, path))
    if isinstance(cls, type) and issubclass(cls, Environment):
        return EnvSpec("environment", cls)
    if isinstance(cls, type) and not callable(getattr(cls, "step", None)):
        return EnvSpec("trl", cls)
    raise ConfigError(
        f"env.path={path!r} names {cls!r}, which is neither a posttrain Environment subclass nor a TRL-style "
        "class (one without a step method, whose public methods are its tools); subclass "
        "posttrain.agents.env.Environment, or drop step() and expose tools as methods"
    )


def _register_skyrl_class(cls: type, path: str) -> str:
    """Register one's own skyrl-gym environment class with skyrl-gym under its `env.path` (its id: rows' own
    ``env_class`` still win), as SkyRL's ``skyrl_gym.register(id, entry_point)`` does in the package's envs."""
    import skyrl_gym  # the class subclasses one of its classes: installed

    registry = skyrl_gym.envs.registration.registry
    if path not in registry:
        skyrl_gym.register(id=path, entry_point=cls)
    return path


def _class_from_path(spec: str, builtin: dict[str, Any]) -> Any:
    file, sep, name = spec.rpartition(":")
    if not sep or not file or not name or not file.endswith(".py"):
        raise ConfigError(
            f"env.path={spec!r} must be a built-in environment ({', '.join(sorted(builtin))}), "
            "'path/to/file.py:ClassName' or 'skyrl:<env_class>'"
        )
    if not Path(file).is_file():
        raise ConfigError(
            f"env.path={spec!r}: file {file!r} not found (relative to the working directory {str(Path.cwd())!r}); "
            "fix the path"
        )
    return function_of(import_file(Path(file), f"env.path={spec!r}"), name, f"env.path={spec!r}", "classes")


def check_env_kwargs(spec: EnvSpec, kwargs: dict[str, Any]) -> None:
    """`env.kwargs` must bind to the environment's constructor (SkyRL's env_config is free-form)."""
    if spec.kind == "none":
        if kwargs:
            raise ConfigError(
                f"env.kwargs={kwargs!r} is set but env.path is empty: there is no environment constructor to "
                "pass them to; set env.path, or drop env.kwargs"
            )
        return
    if spec.kind == SKYRL:
        return
    if spec.cls is PythonEnv:  # its sandbox is the run's, not a key of env.kwargs
        kwargs = {**kwargs, "sandbox": None}
    try:
        signature = inspect.signature(spec.cls)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        accepted = [
            p.name for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        unknown = [k for k in kwargs if k not in accepted]
        key = f"env.kwargs.{unknown[0]}" if unknown else "env.kwargs"
        value = kwargs[unknown[0]] if unknown else kwargs
        shown = ", ".join(
            p.name + ("" if p.default is p.empty else f"={p.default!r}")
            for p in signature.parameters.values()
            if p.name in accepted
        )
        moved = (
            "; the tool schemas are left out of the prompt with rollout.multi_turn.render_tools=false (for any "
            "environment) instead"
            if "show_schemas" in unknown
            else ""
        )
        raise ConfigError(
            f"{key}={value!r} does not fit {spec.name}({shown}) ({exc}); its constructor takes "
            f"{accepted or 'no arguments'}: set env.kwargs.NAME=VALUE for those only{moved}"
        ) from None


def load_tools(cfg: PostTrainConfig) -> ToolSet:
    """The tools of `rollout.multi_turn.tool_config_path` (none when unset); errors name the key."""
    path = cfg.rollout.multi_turn.tool_config_path
    if not path:
        return ToolSet([])
    try:
        return load_tool_config(path)
    except ConfigError as exc:
        message = str(exc)
        if "rollout.multi_turn.tool_config_path" not in message:
            message = f"rollout.multi_turn.tool_config_path={path!r}: {message}"
        raise type(exc)(message) from exc


def _plain_or_skyrl_row(row: dict[str, Any], tools: ToolSet, calls: int, timeout: float) -> Environment:
    """Without `env.path`: the tool environment, or skyrl-gym for a row in SkyRL's format (with ``env_class``)."""
    if row.get("env_class"):
        if len(tools):
            raise ConfigError(
                f"a row names env_class={row['env_class']!r} (SkyRL's format) and "
                "rollout.multi_turn.tool_config_path is set: SkyRL environments run their own tools; drop the "
                "tool config, or the rows' env_class"
            )
        return SkyRLEnvironment()
    return ToolEnvironment(tools, calls, timeout)


def environment_factory(cfg: PostTrainConfig, sandbox: RunSandbox | None = None) -> EnvFactory:
    """``make_env(row)`` for this run's multi-turn rollouts (see the module docstring). ``sandbox``: the run's,
    where the python tool runs code (one of the `sandbox` section's own when none is given)."""
    mt, env = cfg.rollout.multi_turn, cfg.env
    tools = load_tools(cfg)
    spec = resolve_env(env.path)
    check_env_kwargs(spec, env.kwargs)
    calls, timeout = mt.max_parallel_calls, mt.tool_timeout_s
    kwargs = dict(env.kwargs)
    if spec.cls is PythonEnv or uses_python(tools):  # the run's sandbox, shared with the code reward
        box = (sandbox or RunSandbox(cfg.sandbox)).get()
        tools = bind_python(tools, box)
        if spec.cls is PythonEnv:  # the run's tool-call limits, unless env.kwargs sets its own
            kwargs = {"max_parallel_calls": calls, "timeout_s": timeout, **kwargs, "sandbox": box}
    if spec.kind == "none":
        return lambda row: _plain_or_skyrl_row(row, bind_row(tools, row), calls, timeout)
    if spec.kind == SKYRL:
        if len(tools):
            raise ConfigError(
                f"rollout.multi_turn.tool_config_path={mt.tool_config_path!r} with env.path={env.path!r}: SkyRL "
                "environments run their own tools; drop the tool config"
            )
        return lambda row: SkyRLEnvironment(spec.skyrl_class, kwargs)
    if spec.kind == "trl":
        return lambda row: TRLStyleEnvironment(spec.cls(**kwargs), timeout, extra_tools=bind_row(tools, row))
    if not len(tools):
        return lambda row: spec.cls(**kwargs)
    return lambda row: WithTools(spec.cls(**kwargs), bind_row(tools, row), calls, timeout)
