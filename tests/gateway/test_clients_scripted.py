"""Each client library's own agent code, unchanged, against the gateway, with scripted replies that call a tool:
the library must parse the tool call the gateway returns, run the tool, send the result back and read the
answer. The tiny model never writes such a call, so the replies are scripted (tests/gateway/support.py)."""

import asyncio
import importlib
import inspect

import pytest

from posttrain.gateway import Gateway
from posttrain.rollout.base import SamplingParams
from tests.gateway.support import scripted_backend

CLIENTS = {  # harness module -> the package it needs
    "openai_chat": "openai",
    "agents_sdk": "agents",
    "langgraph_agent": "langgraph",
    "smolagents_agent": "smolagents",
    "verifiers_env": "verifiers",
}
CALL = '<tool_call>\n{"name": "add_numbers", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
FINAL = '<tool_call>\n{"name": "final_answer", "arguments": {"answer": "5"}}\n</tool_call>'


def scripted_reply(tok):
    """A tool call first; once a tool result is in the prompt, the answer (smolagents, whose prompt names its
    final_answer tool, takes the answer as a call of that tool)."""

    def reply(request) -> str:
        text = tok.decode(request.ids)
        if "<tool_response>" not in text and "Observation:" not in text:
            return CALL
        return FINAL if "final_answer" in text else "The sum is 5."

    return reply


def run_harness(name: str, base_url: str, api_key: str) -> dict:
    run = importlib.import_module(f"tests.gateway.clients.{name}").run
    out = run({"prompt": "What is 2 + 3?", "ground_truth": "5"}, base_url, api_key)
    return asyncio.run(out) if inspect.iscoroutine(out) else out


@pytest.mark.parametrize("name", list(CLIENTS))
def test_the_client_library_runs_a_tool_call_and_answers(tok, name):
    pytest.importorskip(CLIENTS[name])
    with Gateway(scripted_backend(tok, scripted_reply(tok)), tok, max_model_len=4096) as gw:
        session = gw.open_session(
            sample_id=0, params=SamplingParams(max_tokens=128), max_response_tokens=1024
        )
        result = run_harness(name, session.base_url, session.api_key)
        records = gw.close_session(session.id)
        metrics = gw.metrics()
    assert result["metrics"]["tool_calls"] >= 1 and metrics["gateway/errors"] == 0
    assert records[0].text == CALL and len(records) >= 2
    if name == "smolagents_agent":
        # smolagents re-renders its memory each step (the call and its observation as its own text), so
        # every step starts a new chain: only the last is trained (harness.on_prefix_break=last)
        assert not any(r.extends_previous for r in records[1:])
        assert result["reward"] == 1.0
    else:  # the library sent its history back unchanged and appended the tool result: one chain
        assert [r.extends_previous for r in records] == [False, True]
        assert records[1].text == "The sum is 5." and result["reward"] == 1.0
