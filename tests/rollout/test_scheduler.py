"""Continuous-batching scheduler on token ids alone: budgets, slots, chunked prefill, prompt sharing."""

import pytest

from posttrain.rollout.native.scheduler import Scheduler

EOS = 0


def _fake_token(sample_id: int, step: int) -> int:
    """A deterministic 'model': samples end on EOS at different lengths (some at once, some never)."""
    return EOS if (sample_id * 7 + step * 3) % 11 == 0 else 1 + (sample_id + step) % 5


def simulate(prompts, *, n, max_tokens, max_num_seqs, max_num_batched_tokens, chunked=True, in_flight=64):
    """Drive the scheduler like the engine does, checking its invariants at every step."""
    sched = Scheduler(
        prompts,
        n=n,
        max_tokens=max_tokens,
        eos_token_ids={EOS},
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        chunked_prefill=chunked,
        max_prompts_in_flight=in_flight,
    )
    prefilled = {p: [] for p in range(len(prompts))}  # chunks seen per prompt
    slot_owner: dict[int, int] = {}  # slot -> prompt whose keys are in positions [0, len(prompt))
    steps = 0
    while not sched.done:
        plan = sched.schedule()
        steps += 1
        assert 0 < plan.num_tokens <= max_num_batched_tokens
        slots = [s.slot for s in plan.decode] + [c.prefill.slot for c in plan.chunks]
        assert len(set(slots)) == len(slots) and all(0 <= s < max_num_seqs for s in slots)
        # Lowest slot first: a call never reaches past its own samples (the engine sizes its cache on it).
        assert all(s < n * min(len(prompts), in_flight) for s in slots)
        assert [s.slot for s in plan.decode] == sorted(s.slot for s in plan.decode)
        assert len(sched.unfinished) <= in_flight
        for sample in plan.decode:  # a decoding sample's slot holds its own prompt
            assert slot_owner[sample.slot] == sample.prompt
        for chunk in plan.chunks:
            prefilled[chunk.prefill.prompt].append((chunk.start, chunk.length))
            slot_owner[chunk.prefill.slot] = chunk.prefill.prompt
            if not chunked:
                assert chunk.start == 0 and chunk.last
        decode_tokens = [_fake_token(s.sample_id, len(s.tokens)) for s in plan.decode]
        first = {
            c.prefill.prompt: (
                [_fake_token(sid, 0) for sid in sched.first_sample_ids(c.prefill.prompt)],
                [0.0] * n,
            )
            for c in plan.chunks
            if c.last
        }
        copies = sched.complete(plan, decode_tokens, [0.0] * len(decode_tokens), first)
        for copy in copies:
            assert copy.length == len(prompts[slot_owner[copy.src]])
            for dst in copy.dst:
                slot_owner[dst] = slot_owner[copy.src]
        for slot, sample in sched.running.items():  # every running sample (incl. new ones) sits on its prompt
            assert slot_owner[slot] == sample.prompt
            assert sample.position == len(prompts[sample.prompt]) + len(sample.tokens) - 1
    for p, chunks in prefilled.items():  # each prompt prefilled exactly once, in order, in pieces
        assert [start for start, _ in chunks] == [
            sum(length for _, length in chunks[:i]) for i in range(len(chunks))
        ]
        assert sum(length for _, length in chunks) == len(prompts[p])
    return sched, steps


def _expected(sample_id: int, max_tokens: int) -> list[int]:
    out = []
    while len(out) < max_tokens:
        out.append(_fake_token(sample_id, len(out)))
        if out[-1] == EOS:
            break
    return out


PROMPTS = [[5] * length for length in (3, 1, 17, 8, 30, 2, 9, 4)]


@pytest.mark.parametrize(
    ("n", "max_num_seqs", "budget", "chunked", "in_flight"),
    [
        (4, 256, 4096, True, 64),  # everything at once
        (4, 8, 8, True, 64),  # tight budget: long prompts are split across steps
        (3, 5, 6, True, 2),  # few slots (not a multiple of n), few prompts in flight
        (2, 6, 30, False, 64),  # no chunking: each prompt in one forward
        (5, 2, 4, True, 64),  # n > max_num_seqs: samples wait and take over their siblings' slots
        (1, 1, 1, True, 64),  # one slot, one token per forward
    ],
)
def test_scheduler_respects_limits_and_completes(n, max_num_seqs, budget, chunked, in_flight):
    sched, _ = simulate(
        PROMPTS,
        n=n,
        max_tokens=6,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        chunked=chunked,
        in_flight=in_flight,
    )
    for index, sample in enumerate(sched.samples):
        assert sample.index == index and sample.prompt == index // n and sample.sample_id == index
        assert sample.tokens == _expected(sample.sample_id, 6)
        assert sample.finish_reason == ("eos" if sample.tokens[-1] == EOS else "length")
    assert sched.claims == 0 and sorted(sched.free) == list(range(max_num_seqs))


def test_more_slots_means_fewer_steps():
    _, narrow = simulate(PROMPTS, n=4, max_tokens=6, max_num_seqs=4, max_num_batched_tokens=64)
    _, wide = simulate(PROMPTS, n=4, max_tokens=6, max_num_seqs=64, max_num_batched_tokens=256)
    assert wide < narrow


def test_prompt_offset_sets_global_sample_ids():
    sched = Scheduler(
        [[1, 2]],
        n=3,
        max_tokens=2,
        eos_token_ids={EOS},
        max_num_seqs=4,
        max_num_batched_tokens=8,
        chunked_prefill=True,
        max_prompts_in_flight=4,
        prompt_offset=5,
    )
    assert sched.first_sample_ids(0) == [15, 16, 17]


def test_scheduler_rejects_impossible_budgets():
    with pytest.raises(ValueError, match="max_num_batched_tokens=2 is below max_num_seqs=4"):
        Scheduler(
            [[1]],
            n=1,
            max_tokens=1,
            eos_token_ids={EOS},
            max_num_seqs=4,
            max_num_batched_tokens=2,
            chunked_prefill=True,
            max_prompts_in_flight=1,
        )
    with pytest.raises(ValueError, match="chunked prefill is off"):
        Scheduler(
            [[1] * 10],
            n=1,
            max_tokens=1,
            eos_token_ids={EOS},
            max_num_seqs=4,
            max_num_batched_tokens=8,
            chunked_prefill=False,
            max_prompts_in_flight=1,
        )
