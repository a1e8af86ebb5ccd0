"""The hermes tool-call format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the
assistant's text, and the concurrent execution of one turn's calls.

Nothing a tool or the model does stops the run: malformed JSON, an unknown tool, wrong arguments, a raising tool
and a timeout each become an error message as the tool result (the model reads it and can learn from it) and a
failure kind (:data:`FAILURE_KINDS`) for the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from posttrain.agents.tools import ToolOutput, ToolSet, argument_error, call_tool

FAILURE_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "unserializable")
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ParsedCall:
    """One ``<tool_call>`` block: the name and arguments, or why it could not be read (``error``)."""

    raw: str
    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class CallResult:
    """The outcome of one call: the text the model reads, a reward contribution, the failure kind or None."""

    name: str
    text: str
    reward: float = 0.0
    failure: str | None = None
    latency_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """Every ``<tool_call>`` block of ``text`` in order (an unclosed last block is read to the end)."""
    out = []
    for match in _BLOCK.finditer(text):
        raw = match.group(1).strip()
        call = ParsedCall(raw=raw)
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            call.error = f"the tool call is not valid JSON ({exc.msg} at position {exc.pos})"
            out.append(call)
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            call.error = 'a tool call must be a JSON object {"name": <tool name>, "arguments": {...}}'
            out.append(call)
            continue
        call.name = data["name"]
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):  # some models send the arguments as a JSON string
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            call.error = f'"arguments" must be a JSON object, got {type(arguments).__name__}'
        else:
            call.arguments = arguments
        out.append(call)
    return out


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """The hermes block for one call, as the chat template renders it (for demonstrations and tests)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _output_text(value: Any) -> tuple[str, float, dict[str, float], str | None]:
    """(text, reward, metrics, failure kind): a value JSON cannot encode is sent as its ``str()``, and counted
    (``unserializable``) since the model then reads a Python repr the author probably did not mean to send."""
    if isinstance(value, ToolOutput):
        return value.text, float(value.reward), dict(value.metrics), None
    if isinstance(value, str):
        return value, 0.0, {}, None
    try:
        return json.dumps(value), 0.0, {}, None
    except (TypeError, ValueError):
        return str(value), 0.0, {}, "unserializable"


async def run_call(call: ParsedCall, tools: ToolSet, timeout_s: float) -> CallResult:
    """One call, never raising: every failure becomes an error message and its kind."""
    if call.error is not None:
        return CallResult(call.name or "?", f"Error: {call.error}.", failure="malformed")
    if call.name not in tools:
        known = ", ".join(sorted(tools.tools)) or "none"
        return CallResult(
            call.name, f"Error: unknown tool {call.name!r}; the tools are: {known}.", failure="unknown_tool"
        )
    tool = tools[call.name]
    problem = argument_error(tool, call.arguments)
    if problem is not None:
        return CallResult(
            call.name, f"Error: wrong arguments for {call.name}: {problem}.", failure="bad_arguments"
        )
    limit = tool.timeout_s or timeout_s
    start = time.perf_counter()
    try:
        value = await asyncio.wait_for(call_tool(tool, call.arguments), timeout=limit)
    except asyncio.TimeoutError:
        text = f"Error: {call.name} timed out after {limit:g} s."
        return CallResult(call.name, text, failure="timeout", latency_s=time.perf_counter() - start)
    except Exception as exc:  # the tool's own error is the model's feedback, not ours
        text = f"Error: {call.name} raised {type(exc).__name__}: {exc}"
        return CallResult(call.name, text, failure="raised", latency_s=time.perf_counter() - start)
    text, reward, metrics, failure = _output_text(value)
    latency = time.perf_counter() - start
    return CallResult(call.name, text, reward=reward, failure=failure, latency_s=latency, metrics=metrics)


async def run_calls(
    calls: list[ParsedCall], tools: ToolSet, max_parallel_calls: int, timeout_s: float
) -> list[CallResult]:
    """One turn's calls, concurrently (at most ``max_parallel_calls`` at a time), results in call order."""
    gate = asyncio.Semaphore(max(1, max_parallel_calls))

    async def bounded(call: ParsedCall) -> CallResult:
        async with gate:
            return await run_call(call, tools, timeout_s)

    return list(await asyncio.gather(*(bounded(c) for c in calls)))
