"""A trajectory's calls (``CallRecord``s, in call order) -> the sample trained on, never re-tokenizing text.

A chain of calls where each one's prompt starts with the chain so far (``extends_previous``) is one
:class:`~posttrain.agents.trajectory.Trajectory` laid out as the native loop lays it out: the first call's prompt,
then per call the template tokens between the chain and its prompt (mask 0) and its sampled ids (mask 1, the
engine's log-probs). A call that does not extend the chain (the harness rewrote its history) starts a new
segment: a prefix break. Its segments are never merged: a merged sample would put tokens the policy did not
sample, in a context it did not see, under mask 1. ``on_prefix_break`` says what is trained: "last" (the last
segment; the earlier ones are dropped and counted) or "fail" (the trajectory is a harness failure).

Why not one sample per segment ("split"): the step's batch plan counts exactly rollout.n samples per prompt
(mini-batch and micro-batch sizes, their split over data-parallel ranks) and group estimators would count a
trajectory with two segments twice in its prompt's group mean and std.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from posttrain.agents.trajectory import Trajectory

if TYPE_CHECKING:  # the server's record type (posttrain.gateway.capture); only read here, by attribute
    from posttrain.gateway.capture import CallRecord

PREFIX_BREAKS = "gateway/prefix_breaks"
DROPPED_TOKENS = "gateway/dropped_assistant_tokens"
OVERRIDDEN = "gateway/overridden_params"


class AssemblyFailure(Exception):
    """The calls cannot make a sample (``kind``: "no_calls" or "prefix_break"); a harness failure."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # caught where it is raised (harness_loop makes it a HarnessFailure): never pickled


@dataclass
class Assembled:
    """The sample (``trajectory``), how many prefix breaks its calls had and how many sampled tokens of
    dropped segments are not trained on."""

    trajectory: Trajectory
    prefix_breaks: int
    dropped_tokens: int


def segments(records: Sequence[CallRecord]) -> list[list[CallRecord]]:
    """The calls cut into chains: a call starts a new chain unless it extends the chain so far, checked on the
    ids themselves (the server's ``extends_previous`` flag must agree with them: a call flagged as extending
    whose prompt does not start with the chain is a break too, so no wrong sample can come of it)."""
    out: list[list[CallRecord]] = []
    chain: list[int] = []
    for record in records:
        if out and record.extends_previous and record.prompt_ids[: len(chain)] == chain:
            out[-1].append(record)
        else:
            out.append([record])
        chain = list(record.prompt_ids) + list(record.completion_ids)
    return out


def chain_trajectory(chain: Sequence[CallRecord], max_response_length: int) -> Trajectory:
    """One chain of calls as a trajectory (layout: see the module docstring). The messages are the last call's
    plus the assistant text it returned, so a reward function scoring the final messages sees the final answer.
    Ids past ``max_response_length`` after the prompt are cut (finish "length"), as the native loop's budget does."""
    first, last = chain[0], chain[-1]
    messages = [dict(m) for m in last.messages] + [{"role": "assistant", "content": last.text}]
    traj = Trajectory(prompt_ids=list(first.prompt_ids), messages=messages)
    context = list(first.prompt_ids)
    for k, record in enumerate(chain):
        if k:
            traj.add_environment(list(record.prompt_ids[len(context) :]))
            traj.num_user_turns += 1
            context = list(record.prompt_ids)
        traj.add_assistant(list(record.completion_ids), list(record.logprobs))
        traj.turn_finish_reasons.append(record.finish_reason)
        context += list(record.completion_ids)
    traj.finish_reason = "length" if last.finish_reason == "length" else "stop"
    if len(traj.response_ids) > max_response_length:
        _cut(traj, max_response_length)
    return traj


def _cut(traj: Trajectory, length: int) -> None:
    """Keep the first ``length`` response ids (turns past them dropped, the one across them shortened)."""
    traj.response_ids, traj.mask, traj.logprobs = (
        traj.response_ids[:length],
        traj.mask[:length],
        traj.logprobs[:length],
    )
    kept = [(start, min(end, length)) for start, end in traj.turns if start < length]
    traj.turn_finish_reasons = traj.turn_finish_reasons[: len(kept)]
    traj.turns = kept
    traj.finish_reason = "length"
    traj.truncations.append("trajectory budget")


def assemble(
    records: Sequence[CallRecord], on_prefix_break: str, max_response_length: int, sample_id: int = 0
) -> Assembled:
    """The sample of one trajectory's calls (``on_prefix_break``: "last" or "fail", see the module docstring).
    AssemblyFailure "no_calls" when the harness made no call, "prefix_break" for a break under "fail"."""
    if not records:
        raise AssemblyFailure("no_calls", "the harness made no model call: there is nothing to train on")
    chains = segments(records)
    breaks = len(chains) - 1
    if breaks and on_prefix_break == "fail":
        at = len(chains[0])
        raise AssemblyFailure(
            "prefix_break",
            f"call {at + 1} of {len(records)} does not extend the conversation of the calls before it (the "
            "harness rewrote its history) and harness.on_prefix_break=fail; send the previous messages and "
            "the returned assistant message unchanged, or set harness.on_prefix_break=last",
        )
    traj = chain_trajectory(chains[-1], max_response_length)
    traj.sample_id = sample_id
    dropped = sum(len(r.completion_ids) for chain in chains[:-1] for r in chain)
    traj.metrics = {
        PREFIX_BREAKS: float(breaks),
        DROPPED_TOKENS: float(dropped),
        OVERRIDDEN: float(sum(len(r.overridden) for r in records)),
        # the tool calls the gateway returned (all segments): the native loop's count, for tool-call rates
        "tool_calls": float(sum(r.tool_calls for r in records)),
    }
    return Assembled(traj, breaks, dropped)
