"""Tools: plain Python functions (sync or async) with type hints and a docstring, and their OpenAI function schemas.

A schema is generated from the signature and the docstring (the first paragraph is the description, a Google-style
``Args:`` section gives each parameter's description), or given explicitly per tool in the tool config file, as
verl's tool YAML does. An explicit schema is checked against the signature when the config loads.

A tool returns a string (the tool message the model reads), any JSON-able value (sent as JSON), or a
:class:`ToolOutput` to also credit a reward contribution to the trajectory. Any other value is sent as its
``str()`` and counted as an ``unserializable`` tool failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import re
import threading
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.config.errors import ConfigError

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


@dataclass
class ToolOutput:
    """What a tool may return instead of a string: the text for the model and a reward contribution."""

    text: str
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Tool:
    """One callable tool: its name (the schema's), the function, its OpenAI schema and an optional timeout."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    timeout_s: float | None = None

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"].get("parameters", {})


def _json_type(annotation: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one parameter annotation (str, int, float, bool, list[...], dict, Literal, X | None)."""
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        kinds = {type(a) for a in args}
        out: dict[str, Any] = {"enum": list(args)}
        if len(kinds) == 1 and next(iter(kinds)) in _JSON_TYPES:
            out["type"] = _JSON_TYPES[next(iter(kinds))]
        return out
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _json_type(rest[0], where)
    if annotation is list or origin is list:
        return {"type": "array", **({"items": _json_type(args[0], where)} if args else {})}
    if annotation is dict or origin is dict:
        return {"type": "object"}
    raise ConfigError(
        f"{where}: the type hint {annotation!r} has no JSON schema type; use str, int, float, bool, list[...], "
        "dict, Literal[...] or X | None, or give the tool's schema explicitly in the tool config"
    )


def _docstring_parts(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a docstring's first paragraph and its ``Args:`` section."""
    doc = inspect.getdoc(fn) or ""
    description = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    params: dict[str, str] = {}
    match = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?)+)", doc, re.MULTILINE)
    if match:
        current = None
        for line in match.group(1).splitlines():
            m = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line)
            if m and (current is None or len(line) - len(line.lstrip()) <= 4):
                current = m.group(1)
                params[current] = m.group(2).strip()
            elif current:
                params[current] = (params[current] + " " + line.strip()).strip()
    return description, params


def _signature_params(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    return [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]


def schema_from_function(fn: Callable[..., Any], name: str | None = None, where: str = "") -> dict[str, Any]:
    """The OpenAI function schema of ``fn`` from its type hints and docstring (every parameter needs a hint)."""
    name = name or fn.__name__
    where = where or f"tool {name!r}"
    description, param_docs = _docstring_parts(fn)
    if not description:
        raise ConfigError(
            f"{where}: the function has no docstring; write one (its first paragraph is the description the "
            "model reads) or give the schema explicitly in the tool config"
        )
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required = []
    for p in _signature_params(fn):
        if p.name not in hints:
            raise ConfigError(
                f"{where}: parameter {p.name!r} has no type hint; add one (e.g. `{p.name}: str`)"
            )
        prop = _json_type(hints[p.name], f"{where}, parameter {p.name!r}")
        if p.name in param_docs:
            prop["description"] = param_docs[p.name]
        properties[p.name] = prop
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def check_schema_matches(fn: Callable[..., Any], schema: Any, where: str) -> None:
    """Raise a ConfigError when an explicit schema does not fit the function's signature."""
    fix = "fix the schema block (or drop it to generate the schema from the signature)"
    function = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ConfigError(
            f"{where}: the schema must look like {{type: function, function: {{name, description, parameters}}}}; "
            + fix
        )
    params = function.get("parameters", {"type": "object", "properties": {}})
    props = params.get("properties", {}) if isinstance(params, dict) else None
    required = params.get("required", []) if isinstance(params, dict) else None
    if not isinstance(props, dict) or not isinstance(required, list):
        raise ConfigError(
            f"{where}: schema parameters need a 'properties' mapping and a 'required' list; {fix}"
        )
    sig = _signature_params(fn)
    names = {p.name for p in sig}
    takes_kwargs = any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()
    )
    unknown = sorted(set(props) - names) if not takes_kwargs else []
    if unknown:
        raise ConfigError(
            f"{where}: schema parameters {unknown} are not parameters of the function {sorted(names)}; {fix}"
        )
    no_default = sorted(p.name for p in sig if p.default is inspect.Parameter.empty)
    missing = sorted(set(no_default) - set(props))
    if missing:
        raise ConfigError(
            f"{where}: the function requires {missing} but the schema does not declare them; {fix}"
        )
    optional_required = sorted(set(no_default) - set(required))
    if optional_required:
        raise ConfigError(
            f"{where}: {optional_required} have no default in the function, so the schema must list them in "
            f"'required'; {fix}"
        )
    undeclared = sorted(set(required) - set(props))
    if undeclared:
        raise ConfigError(
            f"{where}: 'required' names {undeclared}, which 'properties' does not declare; {fix}"
        )
    _check_types_match(fn, props, where, fix)


def _check_types_match(fn: Callable[..., Any], props: dict[str, Any], where: str, fix: str) -> None:
    """A schema type the function's hint contradicts (``integer`` for a ``str``) makes every call fail: the
    arguments are checked against the schema, then the function gets a value of a type it does not expect."""
    hints = typing.get_type_hints(fn)
    for name, prop in props.items():
        declared = prop.get("type") if isinstance(prop, dict) else None
        if name not in hints or declared is None:
            continue
        try:
            expected = _json_type(hints[name], where).get("type")
        except ConfigError:  # a hint without a JSON type (a class of the user's): nothing to compare
            continue
        declared_types = declared if isinstance(declared, list) else [declared]
        fits = {expected, "integer"} if expected == "number" else {expected}  # an int is a valid float
        if expected is not None and not fits & set(declared_types) - {"null"}:
            raise ConfigError(
                f"{where}: the schema declares parameter {name!r} as type {declared!r} but the function's hint is "
                f"{_hint_name(hints[name])} (JSON type {expected!r}); the model's arguments follow the schema, so "
                f"every call would pass the function a value of the wrong type; {fix}, or change the hint"
            )


def _hint_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else repr(hint)


def make_tool(
    fn: Callable[..., Any],
    schema: dict[str, Any] | None = None,
    timeout_s: float | None = None,
    where: str = "",
) -> Tool:
    """A :class:`Tool` from a function, with its schema generated or (when given) checked against the signature."""
    where = where or f"tool {getattr(fn, '__name__', fn)!r}"
    if schema is None:
        schema = schema_from_function(fn, where=where)
    else:
        check_schema_matches(fn, schema, where)
    return Tool(name=schema["function"]["name"], fn=fn, schema=schema, timeout_s=timeout_s)


class ToolSet:
    """Tools by name, their schemas for the chat template, and argument checks before a call."""

    def __init__(self, tools: list[Tool]) -> None:
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ConfigError(f"tool {tool.name!r} is defined twice; give each tool a unique name")
            self.tools[tool.name] = tool

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    def __getitem__(self, name: str) -> Tool:
        return self.tools[name]

    def __len__(self) -> int:
        return len(self.tools)

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]


def argument_error(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """Why ``arguments`` do not fit the tool (unknown/missing names, JSON type mismatch), or None if they do."""
    try:
        inspect.signature(tool.fn).bind(**arguments)
    except TypeError as exc:
        return str(exc)
    props = tool.parameters.get("properties", {})
    for key, value in arguments.items():
        expected = props.get(key, {}).get("type")
        if expected and not _is_json_type(value, expected):
            return f"argument {key!r} must be of type {expected}, got {type(value).__name__} {value!r}"
        enum = props.get(key, {}).get("enum")
        if enum is not None and value not in enum:
            return f"argument {key!r} must be one of {enum}, got {value!r}"
    return None


def _is_json_type(value: Any, expected: str) -> bool:
    if expected == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    python = {"string": str, "boolean": bool, "array": list, "object": dict}.get(expected)
    return python is None or isinstance(value, python)


async def call_tool(tool: Tool, arguments: dict[str, Any]) -> Any:
    """Run the tool: an async function is awaited, a sync one runs in a daemon thread of its own.

    A sync tool that times out cannot be stopped: its thread runs to the end and its result is dropped. Being a
    daemon, the thread never holds up the end of the process (a pool's worker threads are joined at exit, so a
    hung tool delayed it by as long as the tool hung).
    """
    if tool.is_async:
        return await tool.fn(**arguments)
    return await in_daemon_thread(functools.partial(tool.fn, **arguments), f"posttrain-tool-{tool.name}")


def in_daemon_thread(fn: Callable[[], Any], name: str) -> asyncio.Future:
    """``fn()`` in a daemon thread of its own, as a future of the running loop (a hung call keeps only its
    thread, and that thread does not keep the process alive)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # timed out and cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:  # handed to the loop, which reports it
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits for this call any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
