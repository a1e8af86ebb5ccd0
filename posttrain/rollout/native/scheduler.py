"""Continuous-batching scheduler: which tokens go into each forward, and which cache slot each sample uses.

Pure bookkeeping on token ids (no tensors, no model), so it is tested on its own. Each step:

1. every running sample contributes one decode token (its last sampled token);
2. the rest of the token budget (``max_num_batched_tokens``) goes to prefill chunks: prompts already being
   prefilled first (oldest first), then new prompts, admitted only while their samples' slots can be reserved;
3. after the forward, the engine samples one token per decode row, and the first token of all ``n`` samples of
   every prompt whose prefill just finished; :meth:`Scheduler.complete` records them, retires finished samples
   and hands their slots on.

A prompt is prefilled once, into one slot. When its prefill ends, its first sample keeps that slot and the other
samples get free slots into which the engine copies the prompt's keys/values (``SlotCopy``). Slot reservation:
an admitted prompt claims ``min(n, max_num_seqs)`` slots until its prefill ends, then one per unfinished sample
(at most ``max_num_seqs``), and a prompt is admitted only when the claims stay within ``max_num_seqs``. So the
decode batch stays full and, when ``n <= max_num_seqs``, a prompt's samples never wait for slots. When
``n > max_num_seqs`` the samples that find no slot wait (their first token is already drawn) and take over a
sibling's slot when it finishes: the prompt's keys are still there, nothing to copy.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Sample:
    """One response being generated. ``index`` is its position in the result (prompt-major)."""

    index: int
    prompt: int
    sample_id: int  # global id: randomness is a function of it (see sampling.py)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    slot: int = -1
    finish_reason: str | None = None
    position: int = -1  # where its last token goes when fed back: prompt length + generated tokens - 1
    step_offset: int = 0  # noise index of its first token (a later turn of a trajectory starts past 0)


@dataclass
class Prefill:
    """A prompt being prefilled into ``slot``; ``done`` of its tokens are in the cache."""

    prompt: int
    slot: int
    done: int = 0


@dataclass
class Chunk:
    """Prompt tokens ``[start, start + length)`` prefilled this step; ``last`` when it ends the prompt."""

    prefill: Prefill
    start: int
    length: int
    last: bool


@dataclass
class SlotCopy:
    """Copy positions ``[0, length)`` of slot ``src`` into each of ``dst`` before the next forward."""

    src: int
    dst: list[int]
    length: int


@dataclass
class Plan:
    """One forward: decode samples (ascending slots), then prefill chunks."""

    decode: list[Sample]
    chunks: list[Chunk]

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(c.length for c in self.chunks)


def next_chunk(pre: Prefill, prompt_length: int, budget: int, chunked: bool) -> Chunk | None:
    """The next chunk of ``pre``'s prompt within ``budget`` tokens; None when the rest does not fit and prompts
    are not chunked."""
    remaining = prompt_length - pre.done
    if remaining > budget and not chunked:
        return None
    length = min(remaining, budget)
    return Chunk(prefill=pre, start=pre.done, length=length, last=length == remaining)


def append_token(sample: Sample, token: int, logprob: float, eos: set[int], max_tokens: int) -> None:
    """Record a sampled token; the sample finishes on an eos token ("eos") or at ``max_tokens`` ("length")."""
    sample.tokens.append(token)
    sample.logprobs.append(logprob)
    sample.position += 1
    if token in eos:
        sample.finish_reason = "eos"
    elif len(sample.tokens) >= max_tokens:
        sample.finish_reason = "length"


def prefill_chunks(
    prefilling: list[Prefill], budget: int, chunk_of: Callable[[Prefill, int], Chunk | None]
) -> tuple[list[Chunk], int]:
    """The next chunks of the prompts being prefilled, oldest first, within ``budget`` tokens; returns them and
    the budget left. ``chunk_of(prefill, budget)`` is None when the prompt does not fit unchunked: it then waits
    for room, and so do the younger ones (their order is kept)."""
    chunks: list[Chunk] = []
    for pre in prefilling:
        if budget <= 0:
            break
        chunk = chunk_of(pre, budget)
        if chunk is None:
            break
        chunks.append(chunk)
        budget -= chunk.length
    return chunks, budget


class Scheduler:
    """Continuous batching of ``n`` samples for each of ``prompts`` (see the module docstring).

    max_num_seqs: cache slots, i.e. sequences (decoding samples + prompts being prefilled) at once.
    max_num_batched_tokens: tokens per forward (decode tokens + prefill chunk tokens); >= max_num_seqs.
    chunked_prefill: split prompts longer than the remaining budget across steps; otherwise a prompt is prefilled
        in one forward (it must fit in max_num_batched_tokens).
    max_prompts_in_flight: prompts admitted but not finished (all samples done) at once.
    prompt_offset: prompt i here is global prompt ``prompt_offset + i``; its sample j has global id
        ``(prompt_offset + i) * n + j``.
    """

    def __init__(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_tokens: int,
        eos_token_ids: set[int],
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool,
        max_prompts_in_flight: int,
        prompt_offset: int = 0,
    ):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} is below max_num_seqs={max_num_seqs}: every "
                "running sample needs one token per step; raise max_num_batched_tokens or lower max_num_seqs"
            )
        longest = max(len(p) for p in prompts)
        if not chunked_prefill and longest > max_num_batched_tokens:
            raise ValueError(
                f"a prompt has {longest} tokens, more than max_num_batched_tokens={max_num_batched_tokens}, and "
                "chunked prefill is off; enable chunked prefill or raise max_num_batched_tokens"
            )
        self.prompts = prompts
        self.n, self.max_tokens, self.eos = n, max_tokens, eos_token_ids
        self.max_num_seqs, self.budget, self.chunked = max_num_seqs, max_num_batched_tokens, chunked_prefill
        self.max_in_flight = max_prompts_in_flight
        self.offset = prompt_offset
        self.samples: list[Sample | None] = [None] * (len(prompts) * n)
        self.waiting: deque[int] = deque(range(len(prompts)))
        self.prefilling: list[Prefill] = []
        self.running: dict[int, Sample] = {}  # slot -> sample
        self.pending: dict[
            int, deque[Sample]
        ] = {}  # prompt -> samples with a first token, waiting for a slot
        self.unfinished: dict[int, int] = {}  # prompt -> samples not finished (prompts in flight)
        self.group_slots: dict[int, set[int]] = {}  # prompt -> slots of its running samples
        self.free: list[int] = list(range(max_num_seqs))  # a heap: lowest slot first keeps decode slots dense
        self.claims = 0
        self.newly_finished: list[Sample] = []  # finished since the last take_finished(), in finishing order

    @property
    def done(self) -> bool:
        return not (self.waiting or self.prefilling or self.running or self.pending)

    def _claim_after_prefill(self, prompt: int) -> int:
        return min(self.max_num_seqs, self.unfinished.get(prompt, 0))

    def schedule(self) -> Plan:
        """The next forward's work: all running samples, then prefill chunks within the token budget."""
        decode = [self.running[s] for s in sorted(self.running)]
        chunks, budget = prefill_chunks(self.prefilling, self.budget - len(decode), self._chunk)
        reserve = min(self.n, self.max_num_seqs)
        while (
            self.waiting
            and budget > 0
            and self.free
            and len(self.unfinished) < self.max_in_flight
            and self.claims + reserve <= self.max_num_seqs
            and (self.chunked or len(self.prompts[self.waiting[0]]) <= budget)
        ):
            prompt = self.waiting.popleft()
            pre = Prefill(prompt=prompt, slot=heapq.heappop(self.free))
            self.prefilling.append(pre)
            self.unfinished[prompt] = self.n
            self.claims += reserve
            chunk = self._chunk(pre, budget)
            chunks.append(chunk)
            budget -= chunk.length
        return Plan(decode=decode, chunks=chunks)

    def _chunk(self, pre: Prefill, budget: int) -> Chunk | None:
        return next_chunk(pre, len(self.prompts[pre.prompt]), budget, self.chunked)

    def take_finished(self) -> list[Sample]:
        """The samples that finished since the last call (each is final: it gets no more tokens)."""
        out, self.newly_finished = self.newly_finished, []
        return out

    def first_sample_ids(self, prompt: int) -> list[int]:
        """Global sample ids of ``prompt``'s n samples (in order)."""
        base = (self.offset + prompt) * self.n
        return list(range(base, base + self.n))

    def first_steps(self, prompt: int) -> list[int]:
        """Noise index of the first token of each of ``prompt``'s n samples (0: a response starts here)."""
        return [0] * self.n

    def complete(
        self,
        plan: Plan,
        decode_tokens: list[int],
        decode_logprobs: list[float],
        first_tokens: dict[int, tuple[list[int], list[float]]],
    ) -> list[SlotCopy]:
        """Record a step's samples; return the cache copies to make before the next forward.

        decode_tokens/logprobs: one per ``plan.decode`` sample. first_tokens: prompt -> (n tokens, n log-probs)
        for every prompt whose prefill ended this step.
        """
        eos, max_tokens = self.eos, self.max_tokens
        for sample, token, logprob in zip(plan.decode, decode_tokens, decode_logprobs):
            # _append inlined: this loop runs for every running sample at every step.
            sample.tokens.append(token)
            sample.logprobs.append(logprob)
            sample.position += 1
            if token in eos:
                sample.finish_reason = "eos"
            elif len(sample.tokens) >= max_tokens:
                sample.finish_reason = "length"
        copies: list[SlotCopy] = []
        for chunk in plan.chunks:
            chunk.prefill.done += chunk.length
            if chunk.last:
                copies += self._start_samples(chunk.prefill, *first_tokens[chunk.prefill.prompt])
        for sample in plan.decode:
            if sample.finish_reason is not None:
                self._retire(sample)
        return copies + self._place_pending()

    def _append(self, sample: Sample, token: int, logprob: float) -> None:
        append_token(sample, token, logprob, self.eos, self.max_tokens)

    def _start_samples(self, pre: Prefill, tokens: list[int], logprobs: list[float]) -> list[SlotCopy]:
        """Prefill of ``pre.prompt`` ended: create its n samples, give them slots, release its claim."""
        self.prefilling.remove(pre)
        prompt, length = pre.prompt, len(self.prompts[pre.prompt])
        live = []
        for j, (sid, token, logprob) in enumerate(zip(self.first_sample_ids(prompt), tokens, logprobs)):
            sample = Sample(index=prompt * self.n + j, prompt=prompt, sample_id=sid, position=length - 1)
            self.samples[sample.index] = sample
            self._append(sample, token, logprob)
            if sample.finish_reason is None:
                live.append(sample)
            else:
                self._finished(prompt)
                self.newly_finished.append(sample)
        self.claims -= min(self.n, self.max_num_seqs)
        if not live:
            heapq.heappush(self.free, pre.slot)
            return []
        self.claims += self._claim_after_prefill(prompt)
        self.group_slots[prompt] = set()
        self._run(live[0], pre.slot)
        dst = []
        for sample in live[1:]:
            if self.free:
                slot = heapq.heappop(self.free)
                self._run(sample, slot)
                dst.append(slot)
            else:
                self.pending.setdefault(prompt, deque()).append(sample)
        return [SlotCopy(src=pre.slot, dst=dst, length=length)] if dst else []

    def _run(self, sample: Sample, slot: int) -> None:
        sample.slot = slot
        self.running[slot] = sample
        self.group_slots[sample.prompt].add(slot)

    def _finished(self, prompt: int) -> None:
        """One sample of ``prompt`` finished: update its claim; forget the prompt when all are done."""
        before = self._claim_after_prefill(prompt)
        self.unfinished[prompt] -= 1
        if self.unfinished[prompt] == 0:
            del self.unfinished[prompt]
        if prompt in self.group_slots:  # prefill ended: the claim follows the unfinished count
            self.claims += self._claim_after_prefill(prompt) - before

    def _retire(self, sample: Sample) -> None:
        """A running sample finished: a waiting sibling takes its slot (the prompt is there), else free it."""
        slot, prompt = sample.slot, sample.prompt
        self.newly_finished.append(sample)
        del self.running[slot]
        self.group_slots[prompt].discard(slot)
        self._finished(prompt)
        waiting = self.pending.get(prompt)
        if waiting:
            self._run(waiting.popleft(), slot)
            if not waiting:
                del self.pending[prompt]
        else:
            heapq.heappush(self.free, slot)
        if prompt not in self.unfinished:
            del self.group_slots[prompt]

    def _place_pending(self) -> list[SlotCopy]:
        """Give free slots to samples still waiting, copying the prompt from a running sibling."""
        copies = []
        for prompt in list(self.pending):
            waiting = self.pending[prompt]
            src = min(self.group_slots[prompt])
            dst = []
            while waiting and self.free:
                slot = heapq.heappop(self.free)
                self._run(waiting.popleft(), slot)
                dst.append(slot)
            if dst:
                copies.append(SlotCopy(src=src, dst=dst, length=len(self.prompts[prompt])))
            if not waiting:
                del self.pending[prompt]
        return copies
