"""The environment interface: small and text-level, sync or async. Tools are one kind of environment.

An environment is made per trajectory. The driver calls:

- ``reset(row)`` once with the data row; it returns the opening messages appended after the row's prompt, or None;
- ``step(text)`` after each assistant turn with the assistant's text; it returns a :class:`StepResult`: the new
  messages (``tool`` or ``user``), a reward for this turn, whether the episode is done, and metrics (numbers by
  name, summed over the episode's steps and logged per trajectory as ``env/<name>``);
- ``metrics()`` for per-episode numbers, and ``close()`` at the end (also after a failure).

Any of them may be ``async def``. ``tool_schemas()`` lists the tools to render in the prompt (None: no tools);
``tool_names()`` every tool the environment answers (its schema listed or not), whose calls are counted per tool.
A single-turn task is the one-step case: an environment whose first ``step`` says done.
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from posttrain.agents.hermes import FAILURE_KINDS, parse_tool_calls, run_calls
from posttrain.agents.tools import ToolSet
from posttrain.agents.trajectory import add_step_metrics

Message = dict[str, Any]


@dataclass
class StepResult:
    """What one environment step returns."""

    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


class Environment:
    """The base environment: single-turn (the first step is done, no reward of its own)."""

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return None

    def tool_names(self) -> list[str]:
        """Every tool the environment answers, listed in the prompt or not (their calls are logged per tool as
        ``tool_call_counts/<name>``, reported by :meth:`metrics` as ``tool_calls/<name>``)."""
        return [s["function"]["name"] for s in self.tool_schemas() or []]

    def reset(self, row: dict[str, Any]) -> list[Message] | None:
        return None

    def step(self, text: str) -> StepResult:
        return StepResult(done=True)

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        return None


async def maybe_await(value: Any) -> Any:
    """``await`` a coroutine; pass any other value through (for sync-or-async environment methods)."""
    if inspect.isawaitable(value):
        return await value
    return value


class ToolEnvironment(Environment):
    """Runs the ``<tool_call>`` blocks of each assistant turn; a turn without a call ends the episode.

    The turn's reward is the sum of the calls' reward contributions, its step metrics the sum of the calls'
    ``ToolOutput.metrics`` per key. Episode metrics: calls per tool, failures per kind, tool time.
    """

    def __init__(self, tools: ToolSet, max_parallel_calls: int = 4, timeout_s: float = 30.0) -> None:
        self.tools = tools
        self.max_parallel_calls = max_parallel_calls
        self.timeout_s = timeout_s
        self.calls: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self.tool_seconds = 0.0

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return self.tools.schemas() if len(self.tools) else None

    def tool_names(self) -> list[str]:
        return list(self.tools.tools)  # also those a subclass keeps out of the prompt

    async def step(self, text: str) -> StepResult:
        calls = parse_tool_calls(text)
        if not calls:
            return StepResult(done=True)
        results = await run_calls(calls, self.tools, self.max_parallel_calls, self.timeout_s)
        metrics: dict[str, float] = {}
        for r in results:
            self.calls[r.name] += 1
            self.tool_seconds += r.latency_s
            if r.failure:
                self.failures[r.failure] += 1
            add_step_metrics(metrics, r.metrics, f"tool {r.name!r}")
        messages = [{"role": "tool", "content": r.text} for r in results]
        return StepResult(messages=messages, reward=sum(r.reward for r in results), metrics=metrics)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            "tool_calls": float(sum(self.calls.values())),
            "tool_seconds": self.tool_seconds,
        }
        out.update({f"tool_calls/{name}": float(n) for name, n in self.calls.items()})
        out.update({f"tool_failures/{kind}": float(self.failures[kind]) for kind in FAILURE_KINDS})
        return out
