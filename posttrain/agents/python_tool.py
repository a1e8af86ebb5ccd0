"""The built-in ``python`` code-interpreter tool and the ``python`` environment: the model's code runs in the
run's sandbox (the `sandbox` config section) and the tool message is its output, or its error.

Two ways to use it:

- ``env.path=python``: a :class:`PythonEnv`, a tool environment with the python tool alone (a turn without a
  tool call ends the episode);
- in a tool config, beside other tools: ``- path: posttrain.agents.python_tool:python``.

The tool runs code in the run's one sandbox (:class:`posttrain.sandbox.build.RunSandbox`, shared with the code
reward), bound to it where the run's environments are made (:func:`bind_python`): the module-level
:func:`python` is its name, signature and description. The multi-turn loop truncates the tool message in tokens
(`rollout.multi_turn.max_tool_response_length`); the sandbox caps it in bytes first (`sandbox.max_output_bytes`).
"""

from __future__ import annotations

from dataclasses import replace

from posttrain.agents.env import ToolEnvironment
from posttrain.agents.tools import Tool, ToolSet, make_tool
from posttrain.sandbox.build import Sandbox
from posttrain.sandbox.run_python import run_python


def python(code: str) -> str:
    """Run Python code in a fresh sandbox and return what it printed, or the error.

    Args:
        code: a complete Python program; print what you want to see, e.g. "print(123 * 456)". There is no
            network, and nothing is kept between calls.
    """
    raise RuntimeError(
        "the python tool runs in the run's sandbox: bind it with posttrain.agents.python_tool.bind_python"
    )


class _BoundPython:
    """The python tool over one sandbox (a class, not a closure: it names itself in errors and pickles)."""

    __name__ = "python"

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    def __call__(self, code: str) -> str:
        return run_python(code, self.sandbox)


def python_tool(sandbox: Sandbox) -> Tool:
    """The python tool, running code in ``sandbox``."""
    plain = make_tool(python)
    return replace(plain, fn=_BoundPython(sandbox))


def bind_python(tools: ToolSet, sandbox: Sandbox) -> ToolSet:
    """``tools`` with the python tool (if it is one of them) running in ``sandbox``, under the name and schema its
    tool config gave it (verl's SandboxFusionTool config calls it ``code_interpreter``)."""
    bound = _BoundPython(sandbox)
    return ToolSet([replace(t, fn=bound) if t.fn is python else t for t in tools.tools.values()])


def uses_python(tools: ToolSet) -> bool:
    return any(tool.fn is python for tool in tools.tools.values())


class PythonEnv(ToolEnvironment):
    """A tool environment with the python tool: each ``<tool_call>`` to ``python`` runs in the sandbox.

    The tool's schema block is in the prompt unless `rollout.multi_turn.render_tools=false`: with the built-in tiny
    tokenizer that block is over 500 tokens, and a model warm-started on demonstrations without it (the
    python_arithmetic benchmark) knows the call format already; with the block it never called the tool (0 of 16
    held-out trajectories).
    """

    def __init__(self, sandbox: Sandbox, max_parallel_calls: int = 4, timeout_s: float = 30.0) -> None:
        super().__init__(ToolSet([python_tool(sandbox)]), max_parallel_calls, timeout_s)
