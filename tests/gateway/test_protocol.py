"""The wire format: every refused input gets its status and a message naming the field (without a retry by the
openai client), accepted-and-ignored fields are counted, tool-call blocks and stop strings are read exactly."""

import copy
import http.client
import json
from urllib.parse import urlsplit

import openai
import pytest

from posttrain.agents.hermes import tool_call_text
from posttrain.agents.render import Renderer
from posttrain.gateway import Gateway
from posttrain.gateway.responses import apply_stop, split_tool_calls
from posttrain.rollout.base import SamplingParams
from tests.gateway.support import client_for, scripted_backend
from tests.gateway.test_server import TOOLS

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def gw(tok):
    with Gateway(scripted_backend(tok, lambda r: "fine"), tok, max_model_len=64, max_request_bytes=4096) as g:
        yield g


@pytest.fixture
def c(gw):
    with client_for(gw.base_url, gw.api_key) as client:
        yield client


def raw(gw, method, path, body=None, headers=None):
    """(status, decoded JSON) of one request sent with http.client (for what the openai client cannot send)."""
    url = urlsplit(gw.root_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    head = {"Authorization": f"Bearer {gw.api_key}", **(headers or {})}
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=head)
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"model": "p", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "not one of"),
        ({"model": "p", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "missing"),
        ({"model": "p", "messages": "hi"}, "messages", "non-empty list"),
        ({"model": "p", "messages": USER, "temperature": "hot"}, "temperature", "must be a number"),
        ({"model": "p", "messages": USER, "max_tokens": 0}, "max_tokens", ">= 1"),
        ({"model": "p", "messages": USER, "n": 2}, "n", "only n=1"),
        ({"model": "p", "messages": USER, "stream": "yes"}, "stream", "true or false"),
        ({"model": "p", "messages": USER, "presence_penalty": 0.5}, "presence_penalty", "only 0"),
        ({"model": "p", "messages": USER, "response_format": {"type": "json_object"}}, "response_format", ""),
        ({"model": "p", "messages": USER, "frobnicate": 1}, "frobnicate", "unknown field"),
        ({"model": "p", "messages": USER, "stop": ["", "x"]}, "stop", "non-empty"),
        ({"model": "p", "messages": USER, "tool_choice": "required"}, "tool_choice", "needs a non-empty"),
        (
            {"model": "p", "messages": USER, "tools": TOOLS,
             "tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "tool_choice", "'mul', which is not in tools",
        ),
        (
            {"model": "p", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]", "only text parts",
        ),
        (
            {"model": "p", "messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}]},
            "messages[1].tool_calls[0].function.arguments", "not valid JSON",
        ),
        ([1, 2], "body", "JSON object"),
    ],
)  # fmt: skip
def test_bad_requests_are_400_naming_the_field(gw, body, param, message):
    status, out = raw(gw, "POST", "/v1/chat/completions", body)
    assert (
        status == 400 and out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error"
    )
    assert out["error"]["message"].startswith(param + ":") and message in out["error"]["message"]


def test_the_openai_client_gets_a_400_once_without_retrying(gw, tok):
    with (
        client_for(gw.base_url, gw.api_key) as c0,
        openai.OpenAI(base_url=gw.base_url, api_key=gw.api_key) as c,
    ):
        assert c.max_retries > 0 and c0.max_retries == 0
        with pytest.raises(openai.BadRequestError, match="robot"):
            c.chat.completions.create(model="p", messages=[{"role": "robot", "content": "x"}])
        with pytest.raises(openai.BadRequestError, match="frobnicate: unknown field"):
            c.chat.completions.create(model="p", messages=USER, extra_body={"frobnicate": 1})
    assert gw.metrics()["gateway/requests"] == 2.0 and gw.metrics()["gateway/errors"] == 2.0


def test_fields_clients_send_are_accepted_and_counted(c, gw):
    r = c.chat.completions.create(
        model="anything", messages=USER, user="u1", metadata={"k": "v"}, seed=1, parallel_tool_calls=True,
        presence_penalty=0, frequency_penalty=0.0, response_format={"type": "text"}, store=False,
    )  # fmt: skip
    assert r.choices[0].message.content == "fine"
    assert gw.metrics()["gateway/ignored_fields"] == 7.0  # seed is honoured here (no session)


def test_context_too_long_is_a_400_with_its_code(c):
    with pytest.raises(openai.BadRequestError, match="context is 64 tokens") as err:
        c.chat.completions.create(model="p", messages=[{"role": "user", "content": "word " * 80}])
    assert err.value.code == "context_length_exceeded"


def test_keys_paths_methods_and_sizes(gw):
    with client_for(gw.base_url, "wrong") as bad_key, pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    status, out = raw(gw, "GET", "/v1/models", headers={"Authorization": ""})
    assert status == 401 and "Authorization: Bearer" in out["error"]["message"]
    assert raw(gw, "GET", "/v2/models")[0] == 404
    assert raw(gw, "GET", "/v1/chat/completions")[0] == 405
    assert raw(gw, "POST", "/v1/models", {})[0] == 405
    assert raw(gw, "PUT", "/v1/chat/completions", {})[0] == 405
    status, out = raw(gw, "POST", "/v1/chat/completions", b"{not json")
    assert status == 400 and out["error"]["message"].startswith("body: is not valid JSON")
    status, out = raw(
        gw, "POST", "/v1/chat/completions", {"model": "p", "messages": USER, "x": "y" * 200_000}
    )
    assert status == 413 and "at most 4096" in out["error"]["message"]
    handle = gw.open_session(sample_id=0, params=SamplingParams(max_tokens=4), max_response_tokens=8)
    status, out = raw(gw, "POST", f"/s/{handle.id}/v1/completions", {"prompt": "x"})
    assert status == 400 and "chat completions only" in out["error"]["message"]
    assert raw(gw, "GET", "/v1/models")[0] == 200  # still serving after all that


def test_tool_call_blocks_become_calls_only_when_valid_and_declared():
    text = (
        "a " + tool_call_text("add", {"a": 1}) + " b <tool_call>{broken</tool_call> "
        + tool_call_text("mul", {}) + " <tool_call>\n" + '{"name": "add", "arguments": {"b": 2}}'
    )  # fmt: skip
    content, calls = split_tool_calls(text, ["add"], "auto")
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"a": 1},
        {"b": 2},
    ]  # unclosed last one
    assert content == "a  b <tool_call>{broken</tool_call> " + tool_call_text("mul", {})
    assert split_tool_calls(text, ["add"], "none") == (text.strip(), [])
    assert split_tool_calls("  ", [], "auto") == (None, [])


def test_stop_strings_cut_after_the_completing_token(tok):
    ids = tok("hello world, bye", add_special_tokens=False)["input_ids"]
    cut, text, hit = apply_stop(tok, ids, ["world", "zzz"])
    assert hit and text == "hello " and "world" in tok.decode(cut) and "world" not in tok.decode(cut[:-1])
    assert apply_stop(tok, ids, ["zzz"]) == (ids, "hello world, bye", False)


def test_messages_the_chat_template_refuses_are_a_400(tok):
    strict = copy.deepcopy(tok)
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system messages here') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    with (
        Gateway(scripted_backend(strict, lambda r: "ok"), strict) as gw,
        client_for(gw.base_url, gw.api_key) as c,
    ):
        with pytest.raises(
            openai.BadRequestError, match="chat template cannot render them.*no system messages"
        ):
            c.chat.completions.create(model="p", messages=[{"role": "system", "content": "x"}, *USER])
        handle = gw.open_session(sample_id=0, params=SamplingParams(max_tokens=4), max_response_tokens=8)
        with client_for(handle.base_url, handle.api_key) as s, pytest.raises(openai.BadRequestError):
            s.chat.completions.create(model="p", messages=[{"role": "system", "content": "x"}, *USER])


def test_text_parts_developer_role_and_max_completion_tokens(tok):
    reply = lambda r: "one two three four five six seven"  # noqa: E731
    with Gateway(scripted_backend(tok, reply), tok) as gw, client_for(gw.base_url, gw.api_key) as c:
        parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
        r = c.chat.completions.create(
            model="p", messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts}],
            max_completion_tokens=3,
        )  # fmt: skip
        expected = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]
        assert r.model_dump()["prompt_token_ids"] == Renderer(tok).prompt_ids(expected)
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
