"""Exact capture: a harness that appends gets the native multi-turn loop's tokens and log-probs bit for bit;
an edited history is re-rendered and marked; the session's budget, per-turn limit, deadline and overrides."""

import time

import openai
import pytest

from posttrain.agents.driver import engine_generate, run_trajectories
from posttrain.agents.env import Environment, StepResult
from posttrain.agents.hermes import tool_call_text
from posttrain.agents.render import Renderer
from posttrain.gateway import Gateway
from posttrain.rollout.base import SamplingParams
from tests.gateway.support import client_for, engine_backend, make_engine, scripted_backend
from tests.gateway.test_server import TOOLS
from tests.helpers import multi_turn_settings

USER = [{"role": "user", "content": "What is 6 times 7?"}]
TOOL_MSG = {"role": "tool", "content": "42"}


class OneToolReply(Environment):
    """Answers the first assistant turn with one tool message, ends the episode after the second."""

    def __init__(self) -> None:
        self.steps = 0

    def step(self, text: str) -> StepResult:
        self.steps += 1
        return StepResult(messages=[dict(TOOL_MSG)]) if self.steps == 1 else StepResult(done=True)


def two_calls(handle):
    """The harness: ask, send the answer back as returned plus a tool result, ask again."""
    with client_for(handle.base_url, handle.api_key) as c:
        first = c.chat.completions.create(model="policy", messages=USER)
        messages = [*USER, first.choices[0].message.model_dump(), {**TOOL_MSG, "tool_call_id": "call_0"}]
        c.chat.completions.create(model="policy", messages=messages)
    return messages


def test_an_appending_harness_gets_the_native_loops_tokens_bit_for_bit(model, tok):
    params = SamplingParams(max_tokens=8, seed=4)
    settings = multi_turn_settings(max_response_length=64, max_tokens_per_turn=8)
    (traj,) = run_trajectories(
        [{"prompt": USER}], lambda row: OneToolReply(), engine_generate(make_engine(model, tok), params), tok,
        settings, sample_ids=[7],
    )  # fmt: skip
    assert traj.num_assistant_turns == 2
    with Gateway(engine_backend(make_engine(model, tok)), tok) as gw:
        handle = gw.open_session(sample_id=7, params=params, max_response_tokens=64, max_tokens_per_turn=8)
        two_calls(handle)
        first, second = gw.close_session(handle.id)
    eos = [] if first.completion_ids[-1] == tok.eos_token_id else [tok.eos_token_id]
    new = Renderer(tok).new_message_ids([TOOL_MSG])
    assert second.prompt_ids == first.prompt_ids + first.completion_ids + eos + new
    assert second.extends_previous and not first.extends_previous
    assert first.prompt_ids == traj.prompt_ids
    assert second.prompt_ids + second.completion_ids == traj.prompt_ids + traj.response_ids
    (a0, a1), (b0, b1) = traj.turns
    assert traj.logprobs[a0:a1] == first.logprobs and traj.logprobs[b0:b1] == second.logprobs
    assert first.text == tok.decode(first.completion_ids, skip_special_tokens=True)


def test_tool_calls_sent_back_as_the_client_returns_them_extend_exactly(tok):
    """The client sends the assistant message back with ids, a JSON-string of the arguments, refusal=None...:
    normalized, it is the message the server returned, so the prompt is extended, not re-rendered."""

    def reply(request):
        n = tok.decode(request.ids).count("<tool_response>")
        return tool_call_text("add", {"a": 1, "b": 2}) if n == 0 else "It is 3."

    params = SamplingParams(max_tokens=64)
    with Gateway(scripted_backend(tok, reply), tok) as gw:
        handle = gw.open_session(sample_id=0, params=params, max_response_tokens=256)
        with client_for(handle.base_url, handle.api_key) as c:
            r = c.chat.completions.create(model="policy", messages=USER, tools=TOOLS)
            call = r.choices[0].message.tool_calls[0]
            messages = [*USER, r.choices[0].message.model_dump(),
                        {"role": "tool", "tool_call_id": call.id, "content": "3"}]  # fmt: skip
            c.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        first, second = gw.close_session(handle.id)
    new = Renderer(tok, tools=TOOLS).new_message_ids([{"role": "tool", "content": "3"}])
    assert second.extends_previous and second.prompt_ids == first.prompt_ids + first.completion_ids + new
    assert first.text == tool_call_text("add", {"a": 1, "b": 2}) and first.finish_reason == "eos"


def test_an_edited_history_is_rendered_whole_and_marked(gateway, tok):
    handle = gateway.open_session(
        sample_id=1, params=SamplingParams(max_tokens=8), max_response_tokens=64, max_tokens_per_turn=8
    )
    messages = two_calls(handle)
    edited = [{"role": "user", "content": "Something else."}, *messages[1:]]
    with client_for(handle.base_url, handle.api_key) as c:
        c.chat.completions.create(model="policy", messages=edited, max_tokens=4)
    first, second, third = gateway.close_session(handle.id)
    assert second.extends_previous and not third.extends_previous
    assert third.prompt_ids == Renderer(tok).prompt_ids(
        [
            {"role": "user", "content": "Something else."},
            {"role": "assistant", "content": messages[1]["content"] or ""},
            TOOL_MSG,
        ]  # fmt: skip
    )
    assert third.messages == edited
    assert gateway.metrics()["gateway/prefix_breaks"] == 1.0


def test_budget_per_turn_limit_and_refusals(gateway, tok):
    handle = gateway.open_session(
        sample_id=2, params=SamplingParams(max_tokens=8), max_response_tokens=12, max_tokens_per_turn=5
    )
    with client_for(handle.base_url, handle.api_key) as c:
        r = c.chat.completions.create(model="policy", messages=USER, max_tokens=50)
        assert r.usage.completion_tokens <= 5
        messages = [*USER, r.choices[0].message.model_dump(), {"role": "user", "content": "more please"}]
        with pytest.raises(openai.BadRequestError, match="token budget is spent") as err:
            c.chat.completions.create(model="policy", messages=messages)
        assert err.value.code == "budget_exhausted"
    (record,) = gateway.close_session(handle.id)
    assert len(record.completion_ids) <= 5
    with (
        client_for(handle.base_url, handle.api_key) as c,
        pytest.raises(openai.BadRequestError, match="closed"),
    ):
        c.chat.completions.create(model="policy", messages=USER)


def test_the_run_decides_sampling_and_records_what_it_overrode(gateway):
    handle = gateway.open_session(
        sample_id=3, params=SamplingParams(max_tokens=8, temperature=0.7), max_response_tokens=64
    )
    with client_for(handle.base_url, handle.api_key) as c:
        c.chat.completions.create(model="policy", messages=USER, temperature=0.7, max_tokens=2)
        c.chat.completions.create(model="policy", messages=USER, temperature=0.2, top_p=0.5, max_tokens=2)
    a, b = gateway.close_session(handle.id)
    assert a.overridden == [] and b.overridden == ["temperature", "top_p"]
    assert gateway.metrics()["gateway/overridden_params"] == 2.0


def test_a_passed_deadline_and_an_unknown_session_are_refused(gateway):
    handle = gateway.open_session(
        sample_id=4,
        params=SamplingParams(max_tokens=8),
        max_response_tokens=64,
        deadline=time.monotonic() - 1,
    )
    with (
        client_for(handle.base_url, handle.api_key) as c,
        pytest.raises(openai.BadRequestError, match="deadline"),
    ):
        c.chat.completions.create(model="policy", messages=USER)
    bogus = handle.base_url.replace(handle.id, "0123456789abcdef")
    with client_for(bogus, handle.api_key) as c, pytest.raises(openai.NotFoundError, match="no session"):
        c.chat.completions.create(model="policy", messages=USER)


def test_open_session_checks_its_arguments(gateway):
    with pytest.raises(ValueError, match="max_response_tokens=0 must be an integer >= 1"):
        gateway.open_session(sample_id=0, params=SamplingParams(max_tokens=4), max_response_tokens=0)


def test_a_repeated_call_draws_fresh_noise(gateway):
    """The same messages twice in a session: the second call starts a new chain, which continues the session's
    noise, so it does not replay the first sample."""
    handle = gateway.open_session(
        sample_id=5, params=SamplingParams(max_tokens=8, seed=2), max_response_tokens=64
    )
    with client_for(handle.base_url, handle.api_key) as c:
        for _ in range(2):
            c.chat.completions.create(model="policy", messages=USER, max_tokens=8)
    a, b = gateway.close_session(handle.id)
    assert a.prompt_ids == b.prompt_ids and not b.extends_previous
    assert a.completion_ids != b.completion_ids


def test_render_tools_false_keeps_the_schemas_out_of_the_prompt_and_still_reads_the_calls(tok):
    """harness.render_tools=false: the prompt is the messages alone (as a native run's
    rollout.multi_turn.render_tools=false renders it), and the declared tool's call still comes back as a tool call."""
    reply = lambda request: tool_call_text("add", {"a": 1, "b": 2})  # noqa: E731
    params = SamplingParams(max_tokens=64)
    with Gateway(scripted_backend(tok, reply), tok) as gw:
        handle = gw.open_session(sample_id=0, params=params, max_response_tokens=256, render_tools=False)
        with client_for(handle.base_url, handle.api_key) as c:
            r = c.chat.completions.create(model="policy", messages=USER, tools=TOOLS)
        (record,) = gw.close_session(handle.id)
    assert record.prompt_ids == Renderer(tok).prompt_ids(USER)
    assert len(record.prompt_ids) < len(Renderer(tok, tools=TOOLS).prompt_ids(USER))
    assert r.choices[0].message.tool_calls[0].function.name == "add" and record.tool_calls == 1
