"""CallRecords -> the trained sample: one chain merges in the native loop's layout (template tokens mask 0,
sampled ids mask 1 with their log-probs); a rewritten history is a counted prefix break, never merged."""

import pytest

from posttrain.gateway.assemble import (
    DROPPED_TOKENS,
    OVERRIDDEN,
    PREFIX_BREAKS,
    AssemblyFailure,
    assemble,
    segments,
)
from posttrain.gateway.capture import CallRecord

USER = [{"role": "user", "content": "hi"}]


def record(prompt, completion, extends=False, finish_reason="eos", messages=(), text="", overridden=()):
    """A CallRecord whose log-probs are -0.1 * (k + 1) per completion id k."""
    logprobs = [-0.1 * (k + 1) for k in range(len(completion))]
    return CallRecord(
        list(prompt),
        list(completion),
        logprobs,
        finish_reason,
        extends,
        list(messages),
        text,
        list(overridden),
    )


def test_an_appending_chain_is_one_trajectory_in_the_native_layout():
    first = record([1, 2, 3], [10, 11], messages=USER, text="a")
    # the next prompt: the chain, the eos the template closes the turn with (99), then a tool message (7, 8)
    second = record(
        [1, 2, 3, 10, 11, 99, 7, 8], [12], extends=True, messages=[*USER, {"role": "tool"}], text="b"
    )
    out = assemble([first, second], "last", 100, sample_id=5)
    t = out.trajectory
    assert t.prompt_ids == [1, 2, 3]
    assert t.response_ids == [10, 11, 99, 7, 8, 12]
    assert t.mask == [1, 1, 0, 0, 0, 1]  # template tokens get no gradient
    assert t.logprobs == pytest.approx([-0.1, -0.2, 0.0, 0.0, 0.0, -0.1])
    assert t.turns == [(0, 2), (5, 6)] and t.num_user_turns == 1 and t.sample_id == 5
    assert out.prefix_breaks == 0 and t.metrics[PREFIX_BREAKS] == 0.0
    assert t.finish_reason == "stop" and t.turn_finish_reasons == ["eos", "eos"]


def test_the_final_messages_end_with_the_returned_answer():
    calls = [
        record([1], [2], messages=USER, text="first"),
        record([1, 2, 3], [4], True, messages=USER, text="42"),
    ]
    t = assemble(calls, "last", 100).trajectory
    assert t.messages == [*USER, {"role": "assistant", "content": "42"}]


def test_a_rewritten_history_is_a_counted_break_and_only_the_last_segment_is_trained():
    calls = [
        record([1, 2], [3, 4], messages=USER, text="x"),
        record([1, 2, 3, 4, 5], [6], True, text="y"),
        record([1, 9, 5], [7, 8], False, text="z"),  # the harness dropped and rewrote earlier turns
    ]
    out = assemble(calls, "last", 100)
    t = out.trajectory
    assert t.prompt_ids == [1, 9, 5] and t.response_ids == [7, 8] and t.mask == [1, 1]
    assert out.prefix_breaks == 1 and t.metrics[PREFIX_BREAKS] == 1.0
    assert out.dropped_tokens == 3 and t.metrics[DROPPED_TOKENS] == 3.0


def test_a_record_flagged_as_extending_whose_ids_do_not_is_a_break():
    calls = [record([1, 2], [3]), record([1, 2, 4, 5], [6], extends=True)]
    assert len(segments(calls)) == 2
    t = assemble(calls, "last", 100).trajectory
    assert t.prompt_ids == [1, 2, 4, 5] and t.mask == [1]  # never [3] beside a context it was not sampled in


def test_on_prefix_break_fail_is_a_harness_failure():
    calls = [record([1, 2], [3]), record([8, 9], [4])]
    with pytest.raises(
        AssemblyFailure, match="call 2 of 2 does not extend .* harness.on_prefix_break=fail"
    ) as e:
        assemble(calls, "fail", 100)
    assert e.value.kind == "prefix_break"


def test_no_calls_is_a_failure():
    with pytest.raises(AssemblyFailure, match="made no model call") as e:
        assemble([], "last", 100)
    assert e.value.kind == "no_calls"


def test_a_trajectory_past_the_budget_is_cut():
    calls = [record([1], [2, 3, 4]), record([1, 2, 3, 4, 5, 6], [7, 8, 9], True, finish_reason="eos")]
    t = assemble(calls, "last", 6).trajectory
    assert t.response_ids == [2, 3, 4, 5, 6, 7] and t.mask == [1, 1, 1, 0, 0, 1]
    assert t.turns == [(0, 3), (5, 6)] and t.finish_reason == "length"


def test_overridden_params_are_counted():
    calls = [record([1], [2], overridden=["temperature", "top_p"]), record([1, 2, 3], [4], True)]
    assert assemble(calls, "last", 100).trajectory.metrics[OVERRIDDEN] == 2.0


def test_the_tool_calls_the_gateway_returned_are_the_trajectorys_tool_call_count():
    first, second = record([1], [2]), record([1, 2, 3], [4], True)
    first.tool_calls, second.tool_calls = 2, 0
    assert assemble([first, second], "last", 100).trajectory.metrics["tool_calls"] == 2.0
