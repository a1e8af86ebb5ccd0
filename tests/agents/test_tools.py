"""Tools: schemas from signatures and docstrings, the tool config file and its errors."""

import json
from typing import Literal

import pytest

from posttrain.agents.tool_config import load_tool_config
from posttrain.agents.tools import make_tool, schema_from_function
from posttrain.config.errors import ConfigError


def search(
    query: str, top_k: int = 3, mode: Literal["web", "news"] = "web", tags: list[str] | None = None
) -> str:
    """Search the web for a query.

    Args:
        query: the words to search for.
        top_k: how many results
            to return.
        mode: where to search.
        tags: optional filters.
    """
    return query


def test_schema_from_signature_and_docstring():
    schema = schema_from_function(search)
    fn = schema["function"]
    assert fn["name"] == "search" and fn["description"] == "Search the web for a query."
    props = fn["parameters"]["properties"]
    assert props["query"] == {"type": "string", "description": "the words to search for."}
    assert props["top_k"] == {"type": "integer", "description": "how many results to return."}
    assert props["mode"]["enum"] == ["web", "news"] and props["mode"]["type"] == "string"
    assert props["tags"]["type"] == "array" and props["tags"]["items"] == {"type": "string"}
    assert fn["parameters"]["required"] == ["query"]


def test_a_function_without_hints_or_docstring_is_a_config_error():
    def nodoc(x: int) -> int:
        return x

    def nohint(x):
        """Doc."""

    with pytest.raises(ConfigError, match="no docstring"):
        schema_from_function(nodoc)
    with pytest.raises(ConfigError, match="'x' has no type hint"):
        schema_from_function(nohint)


def _write(tmp_path, text, name="tools.yaml"):
    (tmp_path / "my_tools.py").write_text(
        "async def add(a: int, b: int = 0) -> int:\n    '''Add two integers.'''\n    return a + b\n"
    )
    path = tmp_path / name
    path.write_text(text)
    return path


def test_tool_config_by_file_and_module_path_with_explicit_schema(tmp_path):
    schema = {
        "type": "function",
        "function": {
            "name": "plus",
            "description": "Add.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        },
    }
    text = json.dumps(
        {
            "tools": [
                {"path": "my_tools.py:add", "timeout_s": 2},
                {"path": "posttrain.agents.builtin_envs:calculator"},
                {"path": "my_tools.py:add", "tool_schema": schema},
            ]
        }
    )
    tools = load_tool_config(_write(tmp_path, text, "tools.json"))
    assert sorted(tools.tools) == ["add", "calculator", "plus"]
    assert tools["add"].timeout_s == 2 and tools["add"].is_async
    assert tools["plus"].schema == schema


@pytest.mark.parametrize(
    "text, message",
    [
        ("tools: [{path: nothere.py:add}]", "file 'nothere.py' not found"),
        ("tools: [{path: my_tools.py:sub}]", "defines no 'sub'; callables defined there: \\['add'\\]"),
        ("tools: [{path: no_such_pkg_xyz.mod:f}]", "cannot import module 'no_such_pkg_xyz.mod'"),
        ("tools: [{path: my_tools.py}]", "must be 'path/to/file.py:function'"),
        ("tools: {", "cannot be read"),
        ("other: 1", "top-level 'tools' list"),
        (
            "tools: [{path: my_tools.py:add, schema: {type: function, function: {name: add, parameters: "
            "{type: object, properties: {a: {type: integer}, c: {type: integer}}, required: [a]}}}}]",
            "\\['c'\\] are not parameters of the function",
        ),
        (
            "tools: [{path: my_tools.py:add, schema: {type: function, function: {name: add, parameters: "
            "{type: object, properties: {b: {type: integer}}, required: []}}}}]",
            "requires \\['a'\\] but the schema does not declare them",
        ),
    ],
)
def test_tool_config_errors_name_the_file_the_tool_and_a_fix(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as info:
        load_tool_config(path)
    assert str(path) in str(info.value)


def test_a_missing_tool_config_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="tool_config_path"):
        load_tool_config(tmp_path / "absent.yaml")


def test_make_tool_checks_an_explicit_schema():
    bad = {"type": "function", "function": {"name": "s", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(ConfigError, match="requires \\['query'\\]"):
        make_tool(search, schema=bad)


def test_a_schema_type_that_contradicts_the_type_hint_is_a_config_error(tmp_path):
    (tmp_path / "codes.py").write_text(
        "def lookup(word: str, n: int = 1) -> str:\n    '''The code of a word.'''\n    return word\n"
    )
    text = (
        "tools: [{path: codes.py:lookup, schema: {type: function, function: {name: lookup, parameters: "
        "{type: object, properties: {word: {type: integer}}, required: [word]}}}}]"
    )
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_tool_config(path)
    message = str(info.value)
    assert str(path) in message and "tools[0]" in message  # the file and the entry
    assert "'word'" in message and "integer" in message and "str" in message  # the values
    assert "every call" in message and "fix" in message  # the rule and the fix


@pytest.mark.parametrize(
    "prop",
    [
        {"type": "integer"},  # an int is a valid float: an `integer` schema for a `float` hint fits
        {"type": ["number", "null"]},
        {"description": "no type: nothing to compare"},
    ],
)
def test_a_schema_type_the_hint_accepts_is_kept(prop):
    def scale(x: float | None) -> str:
        """Scale."""
        return str(x)

    schema = {
        "type": "function",
        "function": {
            "name": "scale",
            "parameters": {"type": "object", "properties": {"x": prop}, "required": ["x"]},
        },
    }
    assert make_tool(scale, schema=schema).schema == schema
