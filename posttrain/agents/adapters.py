"""Environments written for the peers, run unchanged through our interface.

- :class:`TRLStyleEnvironment`: a class with ``reset(**row)`` returning an opening text or None, public methods
  as tools (type hints and docstrings give their schemas), and an optional ``get_reward()`` read at the end.
- :class:`SkyRLEnvironment`: an environment of the ``skyrl-gym`` package (an optional extra) made from a row in
  SkyRL's dataset format (``prompt`` messages, ``env_class``, ``reward_spec``, ``extra_info``).
"""

from __future__ import annotations

import inspect
from typing import Any

from posttrain.agents.env import Environment, Message, StepResult, ToolEnvironment, maybe_await
from posttrain.agents.hermes import parse_tool_calls
from posttrain.agents.tools import ToolSet, make_tool
from posttrain.config.errors import ConfigError

_TRL_RESERVED = {"reset", "get_reward"}


class TRLStyleEnvironment(Environment):
    """A TRL-style environment object: its public methods are the tools, ``reset(**row)`` starts an episode.

    The text ``reset`` returns (if any) becomes a user message after the row's prompt. The episode ends at the
    first assistant turn without a tool call; ``get_reward()``, when defined, is then added to that turn's reward.
    The methods share the object's state, so one turn's calls run one after another, in the order the model
    wrote them: run side by side, a read could see the state before or after a write depending on the thread
    scheduler.
    """

    def __init__(
        self,
        obj: Any,
        timeout_s: float = 30.0,
        extra_tools: ToolSet | None = None,
    ) -> None:
        self.obj = obj
        name = type(obj).__name__
        methods = [
            make_tool(getattr(obj, n), where=f"environment {name}, tool method {n!r}")
            for n in sorted(dir(obj))
            if not n.startswith("_") and n not in _TRL_RESERVED and inspect.ismethod(getattr(obj, n, None))
        ]
        extra = list(extra_tools.tools.values()) if extra_tools else []
        clash = sorted({t.name for t in methods} & {t.name for t in extra})
        if clash:
            raise ConfigError(
                f"environment {name} has method(s) {clash} and the tool config defines tool(s) of the same name; "
                "rename one of them"
            )
        self.inner = ToolEnvironment(ToolSet(methods + extra), max_parallel_calls=1, timeout_s=timeout_s)

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return self.inner.tool_schemas()

    def tool_names(self) -> list[str]:
        return self.inner.tool_names()

    async def reset(self, row: dict[str, Any]) -> list[Message] | None:
        if not hasattr(self.obj, "reset"):
            return None
        text = await maybe_await(self.obj.reset(**row))
        return [{"role": "user", "content": str(text)}] if text else None

    async def step(self, text: str) -> StepResult:
        result = await self.inner.step(text)
        if result.done and hasattr(self.obj, "get_reward"):
            result.reward += float(await maybe_await(self.obj.get_reward()))
        return result

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics()


class WithTools(Environment):
    """An environment plus the tools of the tool config: a turn whose tool calls all name those tools is answered
    by them (the episode goes on); any other turn (no call, or a call the environment handles) goes to the
    environment's own ``step``. The prompt lists the environment's tools, then the config's."""

    def __init__(
        self, env: Environment, tools: ToolSet, max_parallel_calls: int = 4, timeout_s: float = 30.0
    ) -> None:
        self.env = env
        self.tools = ToolEnvironment(tools, max_parallel_calls, timeout_s)
        own = {s["function"]["name"] for s in env.tool_schemas() or []}
        clash = sorted(own & set(tools.tools))
        if clash:
            raise ConfigError(
                f"environment {type(env).__name__} already has tool(s) {clash} and the tool config defines "
                "tool(s) of the same name; rename one of them"
            )

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return (self.env.tool_schemas() or []) + self.tools.tools.schemas()

    def tool_names(self) -> list[str]:
        return self.env.tool_names() + self.tools.tool_names()

    async def reset(self, row: dict[str, Any]) -> list[Message] | None:
        return await maybe_await(self.env.reset(row))

    async def step(self, text: str) -> StepResult:
        calls = parse_tool_calls(text)
        if calls and all(getattr(c, "name", None) in self.tools.tools for c in calls):
            return await self.tools.step(text)
        return await maybe_await(self.env.step(text))

    def metrics(self) -> dict[str, float]:
        return {**self.tools.metrics(), **self.env.metrics()}

    def close(self) -> None:
        self.env.close()


class SkyRLEnvironment(Environment):
    """A ``skyrl-gym`` environment per row: ``env_class`` from the row (or the default given here).

    The row's fields other than ``prompt`` and ``env_class`` are SkyRL's ``extras`` (``reward_spec``,
    ``extra_info``, ...), passed as they are. SkyRL's ``init(prompt)`` may add opening messages after the
    prompt; its ``step`` observations, reward and done map one to one.
    """

    def __init__(self, env_class: str | None = None, env_config: dict[str, Any] | None = None) -> None:
        self.env_class = env_class
        self.env_config = env_config or {}
        self.env: Any = None
        self.calls: dict[str, int] = {}

    def reset(self, row: dict[str, Any]) -> list[Message] | None:
        try:
            import skyrl_gym
        except ImportError as exc:
            raise ConfigError(
                "SkyRL environments need the skyrl-gym package: pip install 'posttrain[skyrl]'"
            ) from exc
        env_class = row.get("env_class") or self.env_class
        if not env_class:
            raise ConfigError(
                "a SkyRL row needs an 'env_class' field (e.g. 'gsm8k_multi_turn'), or set a default"
            )
        extras = {k: v for k, v in row.items() if k not in ("prompt", "env_class")}
        extras.setdefault("extra_info", {})
        try:
            self.env = skyrl_gym.make(env_class, env_config=self.env_config, extras=extras)
        except Exception as exc:
            known = sorted(skyrl_gym.envs.registration.registry) if hasattr(skyrl_gym, "envs") else []
            raise ConfigError(
                f"skyrl-gym cannot make env_class={env_class!r}: {exc}; registered: {known}"
            ) from exc
        self._count_tool_calls(self.env)
        prompt = list(row.get("prompt") or [])
        messages, _info = self.env.init(prompt)
        messages = list(messages)
        if messages[: len(prompt)] != prompt:
            raise ConfigError(
                f"SkyRL environment {env_class!r} rewrote the prompt in init(); only appended opening messages "
                "are supported"
            )
        return messages[len(prompt) :] or None

    def step(self, text: str) -> StepResult:
        out = self.env.step(text)
        return StepResult(
            messages=list(out.get("observations") or []),
            reward=float(out.get("reward") or 0.0),
            done=bool(out["done"]),
        )

    def _count_tool_calls(self, env: Any) -> None:
        """Count the environment's tool calls per tool: skyrl-gym environments run their tools through
        ``_execute_tool(group, name, input)`` (BaseTextEnv's), which is wrapped on this instance."""
        execute = getattr(env, "_execute_tool", None)
        if execute is None:
            return

        def counted(group: str, name: str, tool_input: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return execute(group, name, tool_input)

        env._execute_tool = counted

    def tool_names(self) -> list[str]:
        """The tools of the environment made for the row (none before ``reset``: env_class is the row's)."""
        groups = getattr(self.env, "tool_to_toolgroup", None) or {}
        return sorted(groups)

    def metrics(self) -> dict[str, float]:
        get = getattr(self.env, "get_metrics", None)
        values = get() if get else {}
        out = {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}
        out["tool_calls"] = float(sum(self.calls.values()))
        out.update({f"tool_calls/{name}": float(n) for name, n in self.calls.items()})
        return out

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
