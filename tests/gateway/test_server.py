"""The gateway through the real openai client over the native engine: chat (with and without tools), streaming,
completions, models, log-probs, stop strings, the token-id extension fields, concurrency, close."""

import json
import subprocess
import sys
import threading
import time

import openai
import pytest

from posttrain.agents.hermes import tool_call_text
from posttrain.agents.render import Renderer
from posttrain.gateway import Gateway
from posttrain.rollout.base import SamplingParams, TurnRequest
from tests.gateway.support import client_for, engine_backend, make_engine, scripted_backend

USER = [{"role": "user", "content": "Say something."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    }
]


def test_chat_returns_the_engines_exact_tokens(client, tok, engine):
    r = client.chat.completions.create(model="policy", messages=USER, max_tokens=8, temperature=0)
    raw = r.model_dump()
    prompt = Renderer(tok).prompt_ids(USER)
    assert raw["prompt_token_ids"] == prompt
    ids = raw["choices"][0]["token_ids"]
    expected = engine.generate_turns([TurnRequest(prompt, 8, 0)], SamplingParams(max_tokens=8, greedy=True))
    assert ids == expected.response_ids[0]
    text = tok.decode(ids, skip_special_tokens=True)
    assert r.choices[0].message.content == (text.strip() or None)
    assert r.choices[0].finish_reason == (
        "length" if len(ids) == 8 and ids[-1] != tok.eos_token_id else "stop"
    )
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ids)
    assert r.usage.total_tokens == len(prompt) + len(ids) and r.object == "chat.completion"
    assert r.model == "policy" and r.choices[0].message.role == "assistant"


def test_chat_with_tools_renders_them_in_the_prompt(client, tok):
    r = client.chat.completions.create(model="policy", messages=USER, tools=TOOLS, max_tokens=4)
    assert r.model_dump()["prompt_token_ids"] == Renderer(tok, tools=TOOLS).prompt_ids(USER)


def test_logprobs_are_the_sampled_tokens(client, tok):
    r = client.chat.completions.create(
        model="policy", messages=USER, max_tokens=6, logprobs=True, top_logprobs=2, seed=3
    )
    ids = r.model_dump()["choices"][0]["token_ids"]
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in ids]
    assert all(c.logprob <= 0 for c in content)
    assert all(len(c.top_logprobs) == 1 and c.top_logprobs[0].logprob == c.logprob for c in content)
    plain = client.chat.completions.create(model="policy", messages=USER, max_tokens=6, seed=3)
    assert plain.choices[0].logprobs is None and plain.model_dump()["choices"][0]["token_ids"] == ids


def test_a_request_seed_makes_the_sessionless_sample_reproducible(client):
    a, b = (client.chat.completions.create(model="p", messages=USER, max_tokens=8, seed=11) for _ in range(2))
    assert a.model_dump()["choices"][0]["token_ids"] == b.model_dump()["choices"][0]["token_ids"]


def test_stop_strings_cut_the_tokens_and_the_text(client, tok):
    full = client.chat.completions.create(model="policy", messages=USER, max_tokens=16, temperature=0)
    ids = full.model_dump()["choices"][0]["token_ids"]
    text = tok.decode(ids, skip_special_tokens=True)
    start = len(tok.decode(ids[:5], skip_special_tokens=True))
    stop = text[start : start + 2]
    assert stop, "the tiny model's text is too short for this test"
    r = client.chat.completions.create(
        model="policy", messages=USER, max_tokens=16, temperature=0, stop=[stop]
    )
    cut = r.model_dump()["choices"][0]["token_ids"]
    k = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k], skip_special_tokens=True))
    assert cut == ids[:k] and r.choices[0].finish_reason == "stop"
    prefix = tok.decode(ids[:k], skip_special_tokens=True)
    assert r.choices[0].message.content == (prefix[: prefix.find(stop)].strip() or None)


def test_streaming_chat(client, tok):
    kwargs = dict(model="policy", messages=USER, max_tokens=8, seed=5)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (whole.choices[0].message.content or "")
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert chunks[0].model_dump()["prompt_token_ids"] == whole.model_dump()["prompt_token_ids"]


def test_tool_calls_are_parsed_and_undeclared_ones_stay_text(tok):
    def reply(request):
        return "Let me add. " + tool_call_text("add", {"a": 1, "b": 2}) + tool_call_text("nope", {})

    with Gateway(scripted_backend(tok, reply), tok) as gw, client_for(gw.base_url, gw.api_key) as c:
        r = c.chat.completions.create(model="policy", messages=USER, tools=TOOLS)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
        assert call.type == "function" and call.id.startswith("call_")
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.content == "Let me add. " + tool_call_text("nope", {})
        none = c.chat.completions.create(model="policy", messages=USER, tools=TOOLS, tool_choice="none")
        assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
        assert none.choices[0].message.content == reply(None)
        named = {"type": "function", "function": {"name": "add"}}
        assert c.chat.completions.create(model="p", messages=USER, tools=TOOLS, tool_choice=named).choices[0]
        chunks = list(c.chat.completions.create(model="policy", messages=USER, tools=TOOLS, stream=True))
        calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
        assert [tc.function.name for tc in calls] == ["add"] and chunks[-1].choices[
            0
        ].finish_reason == "tool_calls"


def test_only_tool_calls_give_null_content(tok):
    reply = lambda r: tool_call_text("add", {"a": 1, "b": 2})  # noqa: E731
    with Gateway(scripted_backend(tok, reply), tok) as gw, client_for(gw.base_url, gw.api_key) as c:
        r = c.chat.completions.create(model="policy", messages=USER, tools=TOOLS)
        assert r.choices[0].message.content is None and len(r.choices[0].message.tool_calls) == 1


def test_completions_with_text_and_token_prompts(client, tok):
    r = client.completions.create(model="policy", prompt="Once upon", max_tokens=6, temperature=0, logprobs=1)
    raw = r.model_dump()["choices"][0]
    assert raw["prompt_token_ids"] == tok("Once upon")["input_ids"]
    assert r.choices[0].text == tok.decode(raw["token_ids"], skip_special_tokens=True)
    assert (
        len(r.choices[0].logprobs.token_logprobs) == len(raw["token_ids"]) and r.object == "text_completion"
    )
    again = client.completions.create(
        model="policy", prompt=raw["prompt_token_ids"], max_tokens=6, temperature=0
    )
    assert again.model_dump()["choices"][0]["token_ids"] == raw["token_ids"]
    chunks = list(client.completions.create(model="policy", prompt="Once upon", max_tokens=6, temperature=0,
                                            stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_models(client):
    assert [m.id for m in client.models.list()] == ["policy"]


def test_backend_errors_answer_500_and_the_server_keeps_serving(tok, engine):
    calls = []

    def flaky(requests, params):
        calls.append(len(requests))
        if len(calls) == 1:
            raise RuntimeError("engine exploded")
        return engine_backend(engine)(requests, params)

    with Gateway(flaky, tok) as gw, client_for(gw.base_url, gw.api_key) as c:
        with pytest.raises(openai.InternalServerError, match="engine exploded"):
            c.chat.completions.create(model="policy", messages=USER, max_tokens=4)
        assert c.chat.completions.create(model="policy", messages=USER, max_tokens=4).choices[0]
        assert gw.metrics()["gateway/errors"] == 1.0 and gw.metrics()["gateway/requests"] == 2.0


def test_concurrent_sessions_keep_their_own_tokens(model, tok):
    """64 sessions at once, two calls each, interleaved; each session's first call samples what a sequential
    run of that sample id samples, and its second call extends its own first."""
    params = SamplingParams(max_tokens=8, seed=1)
    engine = make_engine(model, tok)
    with Gateway(engine_backend(engine), tok) as gw:
        handles = [gw.open_session(sample_id=s, params=params, max_response_tokens=64) for s in range(64)]
        errors = []

        def run(s, handle):
            try:
                with client_for(handle.base_url, handle.api_key) as c:
                    msgs = [{"role": "user", "content": f"question {s}"}]
                    r = c.chat.completions.create(model="policy", messages=msgs, max_tokens=8)
                    msgs += [r.choices[0].message.model_dump(), {"role": "user", "content": "more"}]
                    c.chat.completions.create(model="policy", messages=msgs, max_tokens=4)
            except Exception as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(s, h)) for s, h in enumerate(handles)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        records = [gw.close_session(h.id) for h in handles]
        assert gw.metrics()["gateway/backend_calls"] < 128  # calls were batched
    sequential = make_engine(model, tok)
    for s, (first, second) in enumerate(records):
        prompt = Renderer(tok).prompt_ids([{"role": "user", "content": f"question {s}"}])
        alone = sequential.generate_turns([TurnRequest(prompt, 8, s, 0, None)], params)
        assert first.prompt_ids == prompt and first.completion_ids == alone.response_ids[0]
        assert second.extends_previous and second.prompt_ids[: len(prompt)] == prompt


def test_close_leaves_no_threads(tok, engine):
    before = set(threading.enumerate())
    gw = Gateway(engine_backend(engine), tok)
    gw.start()
    c = client_for(gw.base_url, gw.api_key)
    c.chat.completions.create(model="policy", messages=USER, max_tokens=2)  # leaves a keep-alive connection
    c.models.list()
    gw.close()
    assert set(threading.enumerate()) - before == set()
    c.close()


def test_one_engine_thread_one_backend_call_per_sampling_setting(tok):
    """Concurrent session-less calls: the backend is only ever called from one thread, once per distinct
    setting in a gathered batch, with the request's temperature/top_p (0: greedy)."""
    seen = []
    gate = threading.Barrier(6)

    def backend(requests, params):
        seen.append((threading.get_ident(), params, len(requests)))
        return scripted_backend(tok, lambda r: "ok")(requests, params)

    with Gateway(backend, tok, default_params=SamplingParams(max_tokens=4, temperature=0.9)) as gw:

        def call(temperature):
            with client_for(gw.base_url, gw.api_key) as c:
                gate.wait()
                c.chat.completions.create(model="p", messages=USER, temperature=temperature, top_p=0.5)

        threads = [threading.Thread(target=call, args=(t,)) for t in (0.3, 0.3, 0.3, 0, 0, None)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len({ident for ident, _, _ in seen}) == 1 and sum(n for _, _, n in seen) == 6
    settings = {(p.temperature, p.greedy, p.top_p) for _, p, _ in seen}
    assert settings == {(0.3, False, 0.5), (1.0, True, 0.5), (0.9, False, 0.5)}
    assert len(seen) <= 6 and all(p.max_tokens == 4 for _, p, _ in seen)


def test_the_gateway_imports_no_openai():
    code = "import sys, posttrain.gateway; assert 'openai' not in sys.modules and 'httpx' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_calls_still_waiting_at_close_get_503_and_the_one_running_finishes(tok):
    release, running = threading.Event(), threading.Event()

    def backend(requests, params):
        running.set()
        release.wait(30)
        return scripted_backend(tok, lambda r: "ok")(requests, params)

    gw = Gateway(backend, tok)
    gw.start()
    results = {}

    def call(name):
        with client_for(gw.base_url, gw.api_key) as c:
            try:
                results[name] = c.chat.completions.create(model="p", messages=USER).choices[0].message.content
            except openai.APIStatusError as exc:
                results[name] = exc.status_code

    first = threading.Thread(target=call, args=("first",))
    first.start()
    assert running.wait(30)
    second = threading.Thread(target=call, args=("second",))
    second.start()
    while not gw.batcher._pending:  # the second call waits behind the running one
        time.sleep(0.01)
    closer = threading.Thread(target=gw.close)
    closer.start()
    while not gw.batcher._stopping:
        time.sleep(0.01)
    release.set()
    for t in (closer, first, second):
        t.join(30)
    assert results == {"first": "ok", "second": 503}
