"""The built-in ``python`` code-interpreter tool and the ``python`` environment: the model's code runs in the
run's sandbox (the `sandbox` config section) and the tool message is its output, or its error.

Two ways to use it:

- ``env.path=python``: a :class:`PythonEnv`, a tool environment with the python tool alone (a turn without a
  tool call ends the episode);
- in a tool config, beside other tools: ``- path: posttrain.agents.python_tool:python``.

The sandbox is built once per run, from the run's `sandbox` section, when the environment factory is made
(:func:`configure_python_tool`; a ConfigError then, before any model loads, when it cannot work here). The multi-turn
loop truncates the tool message in tokens (`rollout.multi_turn.max_tool_response_length`); the sandbox caps it in
bytes first (`sandbox.max_output_bytes`).
"""

from __future__ import annotations

import threading
from typing import Any

from posttrain.agents.env import ToolEnvironment
from posttrain.agents.tools import ToolSet, make_tool
from posttrain.config.schema.sandbox import SandboxConfig
from posttrain.sandbox.build import Sandbox, build_sandbox
from posttrain.sandbox.python_tool import run_python

_LOCK = threading.Lock()
_CURRENT: list[tuple[SandboxConfig, Sandbox]] = []  # the run's (config, sandbox), at most one


def configure_python_tool(cfg: SandboxConfig) -> Sandbox:
    """The sandbox the python tool runs code in, built from ``cfg`` (reused while the config is the same)."""
    with _LOCK:
        if _CURRENT and _CURRENT[0][0] == cfg:
            return _CURRENT[0][1]
        box = build_sandbox(cfg)
        if _CURRENT:
            _CURRENT.pop()[1].close()
        _CURRENT.append((cfg, box))
        return box


def current_sandbox() -> Sandbox:
    """The configured sandbox (the `sandbox` defaults when no run configured one)."""
    with _LOCK:
        if _CURRENT:
            return _CURRENT[0][1]
    return configure_python_tool(SandboxConfig())


def python(code: str) -> str:
    """Run Python code in a fresh sandbox and return what it printed, or the error.

    Args:
        code: a complete Python program; print what you want to see, e.g. "print(123 * 456)". There is no
            network, and nothing is kept between calls.
    """
    return run_python(code, current_sandbox())


def python_tools() -> ToolSet:
    """A tool set holding the python tool alone."""
    return ToolSet([make_tool(python)])


def uses_python(tools: ToolSet) -> bool:
    return any(tool.fn is python for tool in tools.tools.values())


class PythonEnv(ToolEnvironment):
    """A tool environment with the python tool: each ``<tool_call>`` to ``python`` runs in the sandbox.

    The tool's schema block is in the prompt unless ``show_schemas=False`` (`env.kwargs={show_schemas: false}`):
    with the built-in tiny tokenizer that block is over 500 tokens, and a model warm-started on demonstrations
    without it (the python_arithmetic benchmark) knows the call format already; with the block it never called
    the tool (0 of 16 held-out trajectories).
    """

    def __init__(
        self, max_parallel_calls: int = 4, timeout_s: float = 30.0, show_schemas: bool = True
    ) -> None:
        super().__init__(python_tools(), max_parallel_calls, timeout_s)
        self.show_schemas = show_schemas

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return super().tool_schemas() if self.show_schemas else None
