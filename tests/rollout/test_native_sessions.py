"""Session bookkeeping of multi-turn rollouts: the LRU cache of prefixes and the turn scheduler, without a model."""

from posttrain.rollout.base import TurnRequest
from posttrain.rollout.native.sessions import SessionCache, reusable_length
from posttrain.rollout.native.turns import TurnScheduler


def test_reusable_length_leaves_one_token_to_compute():
    assert reusable_length([1, 2, 3], [1, 2, 3, 4, 5]) == 3  # extends: the whole cached prefix
    assert reusable_length([1, 2, 3], [1, 2, 3]) == 2  # same ids: the last one is computed again
    assert reusable_length([1, 2, 3, 4], [1, 2, 9, 4, 5]) == 2  # re-rendered differently: the common prefix
    assert reusable_length([7], [1, 2]) == 0


def test_session_cache_evicts_least_recently_used_and_spares_wanted():
    cache = SessionCache()
    cache.sync(generation=1)
    for session, slot in (("a", 0), ("b", 1), ("c", 2)):
        assert cache.put(session, slot, [slot]) is None
    assert cache.put("a", 0, [0, 5]) is None  # "a" is now the most recent
    assert cache.evict(spare={"b"}) == 2  # "b" is older but spared
    assert cache.evict() == 1 and cache.slots() == {0}
    assert cache.put("a", 3, [1]) == 0  # a second request of "a" in one call: the old slot is handed back
    assert cache.take("a").slot == 3 and len(cache) == 0 and cache.evict() is None
    cache.put("x", 4, [1])
    cache.sync(generation=1)
    assert "x" in cache
    cache.sync(generation=2)  # the cache was re-allocated: nothing survives
    assert "x" not in cache


def _run(sched, tokens_of):
    """Drive ``sched`` without a model: the token sampled at step k of request i is tokens_of(i, k)."""
    plans = []
    while not sched.done:
        plan = sched.schedule()
        plans.append(plan)
        decode = [tokens_of(s.prompt, len(s.tokens)) for s in plan.decode]
        first = {c.prefill.prompt: ([tokens_of(c.prefill.prompt, 0)], [0.0]) for c in plan.chunks if c.last}
        assert sched.complete(plan, decode, [0.0] * len(decode), first) == []
    return plans


def test_turn_scheduler_reuses_a_session_slot_and_keeps_it_after_the_turn():
    sessions = SessionCache()
    sessions.put("s", 1, [5, 6, 7, 8])  # slot 1 holds 4 positions of this session
    requests = [
        TurnRequest(ids=[5, 6, 7, 8, 9, 10], max_tokens=3, sample_id=4, position=6, session="s"),
        TurnRequest(ids=[1, 2, 3], max_tokens=2, sample_id=9),
    ]
    sched = TurnScheduler(
        requests,
        eos_token_ids={0},
        num_slots=2,
        max_num_batched_tokens=8,
        chunked_prefill=True,
        sessions=sessions,
    )
    first = sched.schedule()
    assert [(c.prefill.slot, c.start, c.length) for c in first.chunks] == [(1, 4, 2), (0, 0, 3)]
    assert sched.first_steps(0) == [6] and sched.first_sample_ids(0) == [4]
    sched.complete(first, [], [], {0: ([11], [0.0]), 1: ([12], [0.0])})
    _run(sched, lambda i, k: 20 + k)
    assert [s.tokens for s in sched.samples] == [[11, 21, 22], [12, 21]]
    assert [s.finish_reason for s in sched.samples] == ["length", "length"]
    assert (sched.prefill_tokens, sched.reused_tokens) == (5, 4)
    assert sessions.peek("s").ids == [5, 6, 7, 8, 9, 10, 11, 21] and sessions.slots() == {1}
