"""Continuous batching of multi-turn requests: one sample per :class:`~posttrain.rollout.base.TurnRequest`.

Same step structure as :class:`~posttrain.rollout.native.scheduler.Scheduler` (decode tokens of running samples
first, then prefill chunks within the token budget, lowest free slot first), so that requests without sessions
are scheduled exactly as ``generate`` schedules the same prompts with ``n=1``. The differences:

- each request has its own ``max_tokens``, global ``sample_id`` and noise offset (``position``);
- a request whose session holds a cached prefix (:class:`~posttrain.rollout.native.sessions.SessionCache`) runs in
  that session's slot and starts its prefill after the reusable prefix;
- a finished request with a session leaves its slot to the session (ids + sampled tokens but the last), and a
  request that needs a slot when none is free evicts the least recently used session. Sessions that requests of
  this call still wait for are evicted only when nothing runs or could run (else the request waits).

Requests are admitted in order, but a request that cannot get a slot does not hold back later ones that own a
cached slot.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque

from posttrain.rollout.base import TurnRequest
from posttrain.rollout.native.scheduler import (
    Chunk,
    Plan,
    Prefill,
    Sample,
    SlotCopy,
    append_token,
    next_chunk,
    prefill_chunks,
)
from posttrain.rollout.native.sessions import SessionCache, reusable_length


class TurnScheduler:
    """Continuous batching of ``requests`` over ``num_slots`` cache slots, some held by ``sessions``.

    Counts ``prefill_tokens`` (request tokens computed) and ``reused_tokens`` (read from a session's slot).
    """

    n = 1  # one sample per request: the engine's step code reads it

    def __init__(
        self,
        requests: list[TurnRequest],
        *,
        eos_token_ids: set[int],
        num_slots: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool,
        sessions: SessionCache,
    ):
        longest = max(len(r.ids) for r in requests)
        if not chunked_prefill and longest > max_num_batched_tokens:
            raise ValueError(
                f"a request has {longest} tokens, more than max_num_batched_tokens={max_num_batched_tokens}, and "
                "chunked prefill is off; enable chunked prefill or raise max_num_batched_tokens"
            )
        if max_num_batched_tokens < num_slots:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} is below the {num_slots} slots: every running "
                "sample needs one token per step"
            )
        self.requests, self.eos, self.sessions = requests, eos_token_ids, sessions
        self.budget, self.chunked = max_num_batched_tokens, chunked_prefill
        self.prompts = [r.ids for r in requests]
        self.samples: list[Sample | None] = [None] * len(requests)
        self.waiting: deque[int] = deque(range(len(requests)))
        self.wanted = Counter(r.session for r in requests if r.session is not None)
        self.prefilling: list[Prefill] = []
        self.running: dict[int, Sample] = {}  # slot -> sample
        held = sessions.slots()
        self.free = [s for s in range(num_slots) if s not in held]  # ascending: already a heap
        self.prefill_tokens = self.reused_tokens = 0
        self._no_slot = False

    @property
    def done(self) -> bool:
        return not (self.waiting or self.prefilling or self.running)

    def first_steps(self, prompt: int) -> list[int]:
        return [self.requests[prompt].position]

    def first_sample_ids(self, prompt: int) -> list[int]:
        return [self.requests[prompt].sample_id]

    def schedule(self) -> Plan:
        """The next forward's work: all running samples, then prefill chunks within the token budget."""
        decode = [self.running[s] for s in sorted(self.running)]
        chunks, budget = prefill_chunks(self.prefilling, self.budget - len(decode), self._chunk)
        passed: deque[int] = deque()
        self._no_slot = False  # set when a request found no slot: no later one of this step finds one either
        while self.waiting and budget > 0:
            index = self.waiting.popleft()
            pre = self._admit(index, budget, evict_wanted=False)
            if pre is None:
                passed.append(index)
                continue
            chunk = self._chunk(pre, budget)
            chunks.append(chunk)
            budget -= chunk.length
        passed.extend(self.waiting)
        self.waiting = passed
        if self.waiting and not (self.running or self.prefilling):
            # Nothing runs that could free a slot: the first waiting request takes a session this call wants.
            self._no_slot = False
            pre = self._admit(self.waiting.popleft(), budget, evict_wanted=True)
            chunks.append(self._chunk(pre, budget))
        return Plan(decode=decode, chunks=chunks)

    def _admit(self, index: int, budget: int, evict_wanted: bool) -> Prefill | None:
        """Give request ``index`` a slot (its session's, a free one, or an evicted session's, one a later request
        of this call wants only with ``evict_wanted``), or None."""
        request = self.requests[index]
        cached = self.sessions.peek(request.session) if request.session is not None else None
        reuse = reusable_length(cached.ids, request.ids) if cached is not None else 0
        if not self.chunked and len(request.ids) - reuse > budget:
            return None
        if cached is not None:
            slot = self.sessions.take(request.session).slot
        elif self.free:
            slot = heapq.heappop(self.free)
        else:
            slot = None if self._no_slot else self.sessions.evict(spare=None if evict_wanted else self.wanted)
            if slot is None:
                self._no_slot = True
                return None
        if request.session is not None:
            self.wanted[request.session] -= 1
            if self.wanted[request.session] == 0:
                del self.wanted[request.session]
        pre = Prefill(prompt=index, slot=slot, done=reuse)
        self.prefilling.append(pre)
        self.reused_tokens += reuse
        self.prefill_tokens += len(request.ids) - reuse
        return pre

    def _chunk(self, pre: Prefill, budget: int) -> Chunk | None:
        return next_chunk(pre, len(self.prompts[pre.prompt]), budget, self.chunked)

    def complete(
        self,
        plan: Plan,
        decode_tokens: list[int],
        decode_logprobs: list[float],
        first_tokens: dict[int, tuple[list[int], list[float]]],
    ) -> list[SlotCopy]:
        """Record a step's samples (as ``Scheduler.complete``; ``first_tokens`` holds one token per request whose
        prefill ended). Nothing is ever copied between slots: returns []."""
        for sample, token, logprob in zip(plan.decode, decode_tokens, decode_logprobs):
            self._append(sample, token, logprob)
        for chunk in plan.chunks:
            pre = chunk.prefill
            pre.done += chunk.length
            if not chunk.last:
                continue
            self.prefilling.remove(pre)
            request = self.requests[pre.prompt]
            sample = Sample(
                index=pre.prompt,
                prompt=pre.prompt,
                sample_id=request.sample_id,
                slot=pre.slot,
                position=len(request.ids) - 1,
                step_offset=request.position,
            )
            self.samples[pre.prompt] = sample
            tokens, logprobs = first_tokens[pre.prompt]
            self._append(sample, tokens[0], logprobs[0])
            if sample.finish_reason is None:
                self.running[pre.slot] = sample
            else:
                self._retire(sample)
        for sample in plan.decode:
            if sample.finish_reason is not None:
                del self.running[sample.slot]
                self._retire(sample)
        return []

    def _append(self, sample: Sample, token: int, logprob: float) -> None:
        append_token(sample, token, logprob, self.eos, self.requests[sample.prompt].max_tokens)

    def _retire(self, sample: Sample) -> None:
        """A sample finished: its session keeps the slot (the last token was never fed back), else it is free."""
        request = self.requests[sample.prompt]
        if request.session is None:
            heapq.heappush(self.free, sample.slot)
            return
        replaced = self.sessions.put(request.session, sample.slot, request.ids + sample.tokens[:-1])
        if replaced is not None:
            heapq.heappush(self.free, replaced)
