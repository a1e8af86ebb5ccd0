"""Per-session capture: each call's exact prompt ids, and the :class:`CallRecord` list a session hands back.

The rule for a call's prompt ids. When the request's messages are the previous call's messages, then the
assistant message the server returned for it, then new messages (compared normalized: role, content text, and tool
calls as (name, parsed arguments), so fields clients drop or add do not matter), the prompt is::

    previous prompt + previous completion (+ eos when the completion did not end with it)
        + Renderer(tokenizer, tools).new_message_ids(new messages)

which is how the native multi-turn loop (``posttrain.agents.driver``) builds its turns, so a harness that only
appends gets the native loop's tokens bit for bit. Otherwise (an edited or trimmed history, changed ``tools``, the
first call) the messages are rendered whole (``Renderer.prompt_ids``), and ``extends_previous`` is true only if
those ids happen to start with the previous prompt + completion (a session's first call: false).

A *chain* is a run of calls each extending the one before; a call that does not extend starts a new chain (a
"prefix break", counted). A call's ``position`` is the number of tokens of its chain after the chain's first
prompt (assistant, template and environment tokens together, as ``data.max_response_length`` counts them in the
native loop); the session's ``max_response_tokens`` bounds it per chain: a call with no budget left is refused
(400), and each call may sample at most min(request's max_tokens, max_tokens_per_turn or no cap, budget left,
max_model_len - prompt length) tokens. Calls of one session are served one at a time, in arrival order.

Sampling noise: a call's ``TurnRequest.position`` (the noise offset) is its position in the chain for the
session's first chain, so those calls sample exactly what the native loop samples. A later chain continues after
the highest noise index the session has used, so a repeated or edited call draws fresh noise instead of
replaying an earlier sample.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from posttrain.agents.render import Renderer, TemplateDriftError
from posttrain.gateway.protocol import ChatRequest, ProtocolError, bad, message_key
from posttrain.rollout.base import SamplingParams


@contextlib.contextmanager
def template_errors() -> Iterator[None]:
    """A chat template that refuses the request's messages (it raised) answers 400, not 500: a retry of the
    same messages cannot succeed."""
    try:
        yield
    except ProtocolError:
        raise
    except Exception as exc:
        raise bad("messages", f"the chat template cannot render them ({type(exc).__name__}: {exc})") from exc


@dataclass
class CallRecord:
    """One call of a session, as the engine saw it."""

    prompt_ids: list[int]  # the ids the engine was given for this call (exactly)
    completion_ids: list[int]  # the ids it sampled (after a stop-string cut)
    logprobs: list[float]  # engine log-prob of each completion id
    finish_reason: str  # the engine's: "eos" | "stop" | "length" ("stop" also after a stop-string cut)
    extends_previous: bool  # prompt_ids starts with the previous call's prompt_ids + completion_ids
    messages: list[dict]  # the request's messages as received
    text: str  # the completion's text as returned to the client (before tool-call parsing)
    overridden: list[str] = field(default_factory=list)  # request sampling params the run overrode
    tool_calls: int = 0  # the tool calls the answer returned (parsed out of ``text``)


@dataclass
class TurnPlan:
    """How one call is sampled: its prompt, its noise offset, its token limit, what was overridden."""

    prompt_ids: list[int]
    extends_previous: bool
    position: int
    max_tokens: int
    overridden: list[str]
    chain_start: int  # length of the first prompt of this call's chain
    noise_base: int  # the noise index of the chain's first sampled token
    noise_position: int  # TurnRequest.position: noise_base + position


@dataclass
class _Last:
    keys: list[tuple]
    returned: tuple
    tools: str
    prompt_ids: list[int]
    completion_ids: list[int]


def overridden_params(req: ChatRequest, params: SamplingParams) -> list[str]:
    """The request's sampling settings that differ from the run's (which are used instead)."""
    s, out = req.sampling, []
    if s.temperature is not None:
        same = s.temperature == 0 if params.greedy else s.temperature == params.temperature
        if not same:
            out.append("temperature")
    if s.top_p is not None and s.top_p != params.top_p:
        out.append("top_p")
    if s.top_k is not None and s.top_k != params.top_k:
        out.append("top_k")
    return out


class Session:
    """One trajectory's calls: builds each call's prompt (module docstring) and keeps its records."""

    def __init__(
        self,
        session_id: str,
        *,
        sample_id: int,
        params: SamplingParams,
        max_response_tokens: int,
        max_tokens_per_turn: int = 0,
        deadline: float | None = None,
        render_tools: bool = True,
    ) -> None:
        self.id = session_id
        self.sample_id = sample_id
        self.params = params
        self.max_response_tokens = max_response_tokens
        self.max_tokens_per_turn = max_tokens_per_turn
        self.deadline = deadline
        self.render_tools = render_tools
        self.lock = threading.Lock()  # held for a whole call: a session's calls are served in turn
        self.records: list[CallRecord] = []
        self.closed = False
        self.prefix_breaks = 0
        self._chain_start = 0  # length of the current chain's first prompt
        self._noise_base = 0  # the current chain's first noise index
        self._noise_end = 0  # one past the highest noise index used by the session
        self._last: _Last | None = None

    def plan(self, req: ChatRequest, tokenizer: Any, max_model_len: int | None) -> TurnPlan:
        """The next call's prompt ids and limits; ProtocolError (400) when it cannot be served."""
        if self.closed:
            raise bad("session", f"session {self.id} is closed; open a new one", code="session_closed")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise bad("session", f"session {self.id}'s deadline has passed", code="deadline_exceeded")
        # render_tools=False: the declared tools are still read out of the answers (responses.py), but their
        # schemas stay out of the prompt, for a model that learned its tools' format in training.
        renderer = Renderer(tokenizer, tools=req.tools if self.render_tools else None)
        tools = json.dumps(req.tools, sort_keys=True)
        ids = self._extension(req, renderer, tools)
        extends = ids is not None
        if ids is None:
            ids = renderer.prompt_ids(req.template_messages)
            last = self._last
            extends = last is not None and ids[: len(last.prompt_ids) + len(last.completion_ids)] == (
                last.prompt_ids + last.completion_ids
            )
        start = self._chain_start if extends else len(ids)
        position = len(ids) - start
        limit = self._limit(req, ids, position, max_model_len)
        base = self._noise_base if extends else self._noise_end
        overridden = overridden_params(req, self.params)
        return TurnPlan(ids, extends, position, limit, overridden, start, base, base + position)

    def _extension(self, req: ChatRequest, renderer: Renderer, tools: str) -> list[int] | None:
        """The exact prompt when the messages extend the previous call and its returned answer, else None."""
        last = self._last
        if last is None or tools != last.tools:
            return None
        keys = [message_key(m) for m in req.template_messages]
        n = len(last.keys)
        if len(keys) <= n + 1 or keys[:n] != last.keys or keys[n] != last.returned:
            return None
        done = last.completion_ids
        eos = [] if done and done[-1] == renderer.eos_id else [renderer.eos_id]
        try:
            new = renderer.new_message_ids(req.template_messages[n + 1 :])
        except TemplateDriftError:  # the template cannot append these messages: render the whole history
            return None
        return last.prompt_ids + done + eos + new

    def _limit(self, req: ChatRequest, ids: list[int], position: int, max_model_len: int | None) -> int:
        if max_model_len is not None and len(ids) >= max_model_len:
            raise bad(
                "messages",
                f"the prompt is {len(ids)} tokens; the model's context is {max_model_len} tokens",
                code="context_length_exceeded",
            )
        budget = self.max_response_tokens - position
        if budget <= 0:
            raise bad(
                "session",
                f"session {self.id}'s token budget is spent ({position} tokens after the first prompt, "
                f"max_response_tokens={self.max_response_tokens})",
                code="budget_exhausted",
            )
        limits = [budget, req.sampling.max_tokens or budget, self.max_tokens_per_turn or budget]
        if max_model_len is not None:
            limits.append(max_model_len - len(ids))
        return min(limits)

    def record(self, req: ChatRequest, plan: TurnPlan, record: CallRecord, returned: dict[str, Any]) -> None:
        """Keep a served call; ``returned``: the assistant message sent back, in template form."""
        if not plan.extends_previous and self.records:
            self.prefix_breaks += 1
        self._chain_start, self._noise_base = plan.chain_start, plan.noise_base
        self._noise_end = max(self._noise_end, plan.noise_position + len(record.completion_ids))
        self.records.append(record)
        self._last = _Last(
            keys=[message_key(m) for m in req.template_messages],
            returned=message_key(returned),
            tools=json.dumps(req.tools, sort_keys=True),
            prompt_ids=plan.prompt_ids,
            completion_ids=record.completion_ids,
        )
