"""NativeEngine.generate_turns: multi-turn requests in one continuous batch, with session prefix reuse."""

import dataclasses

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from posttrain.models.tiny import build_tiny_model
from posttrain.rollout.base import SamplingParams, TurnEngine, TurnRequest
from posttrain.rollout.native import graphs
from posttrain.rollout.native.engine import NativeEngine
from tests.helpers import assert_fp32_close

PAD = 0
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "tie_word_embeddings": False}
GREEDY = SamplingParams(max_tokens=1, greedy=True)
SAMPLED = SamplingParams(max_tokens=1, temperature=1.3, top_p=0.95, top_k=100, seed=23)
ENV = [[40, 41, 42], [43, 44], [45, 46, 47, 48]]  # "environment" ids appended after each turn


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok, seed=0, **SMALL)


@pytest.fixture(scope="module")
def prompts(tok):
    texts = [
        "What is 1 + 2?",
        "Hi",
        "The quick brown fox jumps over the lazy dog and then",
        "7",
        "Hello there",
    ]
    return [tok.encode(t) for t in texts]


def _engine(model, eos=(PAD,), **kwargs):
    return NativeEngine(model, eos_token_ids=list(eos), pad_token_id=PAD, **kwargs)


def _same(got, expected, exact=False):
    """Same tokens and finish reasons; log-probs bit-equal (``exact``) or fp32-close."""
    assert got.response_ids == expected.response_ids
    assert got.finish_reasons == expected.finish_reasons
    for a, b in zip(got.response_logprobs, expected.response_logprobs):
        if exact:
            assert torch.equal(torch.tensor(a), torch.tensor(b))
        else:
            assert_fp32_close(torch.tensor(a), torch.tensor(b))


def _exchange(engine, prompts, params, *, sessions=True, max_tokens=(6, 4, 9, 5, 7), turns=3, only=None):
    """A synthetic multi-turn exchange: each turn, every trajectory (or those in ``only``) sends its whole
    context; its sampled tokens and a few "environment" ids are appended. Returns the results and the
    generation metrics of every turn."""
    ids = [list(p) for p in prompts]
    position = [0] * len(prompts)
    results, metrics = [], []
    for turn in range(turns):
        chosen = list(range(len(prompts))) if only is None else only[turn]
        requests = [
            TurnRequest(
                ids=list(ids[i]),
                max_tokens=max_tokens[i % len(max_tokens)] + turn,
                sample_id=100 + i,
                position=position[i],
                session=i if sessions else None,
            )
            for i in chosen
        ]
        out = engine.generate_turns(requests, params)
        assert out.prompt_index == list(range(len(requests)))
        for i, response in zip(chosen, out.response_ids):
            env = ENV[turn % len(ENV)]
            ids[i] += response + env
            position[i] += len(response) + len(env)
        results.append((requests, out))
        metrics.append(engine.generation_metrics())
    return results, metrics


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_position_zero_samples_what_generate_samples(model, prompts, params):
    """A request at position 0 gets generate([ids], n=1, prompt_offset=sample_id)'s sample, bit for bit: alone,
    and as one of a batch scheduled like generate's (same prompts, consecutive sample ids, no sessions)."""
    engine = _engine(model, max_num_seqs=4, max_num_batched_tokens=16)
    assert isinstance(engine, TurnEngine)
    one = dataclasses.replace(params, max_tokens=7)
    got = engine.generate_turns([TurnRequest(ids=prompts[2], max_tokens=7, sample_id=11)], params)
    _same(got, engine.generate([prompts[2]], one, prompt_offset=11), exact=True)
    for settings in ({}, {"max_num_seqs": 2, "max_num_batched_tokens": 3}):
        engine = _engine(model, **settings)
        requests = [TurnRequest(ids=p, max_tokens=7, sample_id=20 + i) for i, p in enumerate(prompts)]
        _same(
            engine.generate_turns(requests, params),
            engine.generate(prompts, one, prompt_offset=20),
            exact=True,
        )


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_mixed_requests_each_sample_their_own(model, prompts, params):
    """Requests of different lengths, limits, sample ids and positions in one batch: each one samples what it
    samples alone (fp32-close: other batch shapes), its limit holds, and a position shifts the noise."""
    engine = _engine(model, max_num_seqs=3, max_num_batched_tokens=8)
    requests = [
        TurnRequest(ids=p, max_tokens=3 + i, sample_id=7 * i, position=(0, 5, 0, 9, 2)[i])
        for i, p in enumerate(prompts)
    ]
    batch = engine.generate_turns(requests, params)
    for i, request in enumerate(requests):
        alone = engine.generate_turns([request], params)
        _same(batch.subset([i], [0]), alone)
        assert len(batch.response_ids[i]) <= request.max_tokens
        if request.position == 0:
            one = dataclasses.replace(params, max_tokens=request.max_tokens)
            _same(alone, engine.generate([request.ids], one, prompt_offset=request.sample_id), exact=True)
    if not params.greedy:
        shifted = [dataclasses.replace(r, position=r.position + 1) for r in requests]
        assert engine.generate_turns(shifted, params).response_ids != batch.response_ids


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_prefix_reuse_equals_full_prefill_and_counts_exactly(model, prompts, params):
    """3 turns with sessions (only each turn's new suffix prefilled) equal 3 turns prefilled in full; the
    engine counts prefilled and reused tokens exactly."""
    reuse, reuse_metrics = _exchange(_engine(model, max_model_len=128), prompts, params)
    full, full_metrics = _exchange(_engine(model, max_model_len=128), prompts, params, sessions=False)
    previous = None
    for (requests, got), (_, expected), counts, full_counts in zip(reuse, full, reuse_metrics, full_metrics):
        _same(got, expected)
        total = sum(len(r.ids) for r in requests)
        reused = 0 if previous is None else sum(len(r.ids) + len(t) - 1 for r, t in zip(*previous))
        assert counts == {"rollout/prefill_tokens": total - reused, "rollout/prefill_reused_tokens": reused}
        assert full_counts == {"rollout/prefill_tokens": total, "rollout/prefill_reused_tokens": 0}
        previous = (requests, got.response_ids)
    assert reuse_metrics[-1]["rollout/prefill_reused_tokens"] > 0


def test_eviction_under_few_slots(model, prompts):
    """More trajectories than slots: sessions are evicted (least recently used first) and prefilled again;
    results stay those of full prefill. Trajectories that wait (not in a call) give their slots up."""
    only = [[0, 1, 2, 3, 4], [0, 1], [2, 3, 4, 0, 1]]
    small = _engine(model, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=128)
    got, counts = _exchange(small, prompts, SAMPLED, only=only)
    expected, _ = _exchange(_engine(model), prompts, SAMPLED, only=only, sessions=False)
    for (_, a), (_, b) in zip(got, expected):
        _same(a, b)
    # Turn 3: trajectories 0 and 1 (turn 2's, held in the two slots) run first in their own slots; 2, 3 and 4
    # wait for slots their sessions lost, and take them once 0 and 1 are done (no longer wanted).
    requests, out = got[1]
    reused = sum(len(r.ids) + len(t) - 1 for r, t in zip(requests, out.response_ids))
    assert counts[2]["rollout/prefill_reused_tokens"] == reused


def test_least_recently_used_session_is_evicted(model, prompts):
    """Two slots: A finishes before B, a new trajectory C evicts A (least recently used); then A's next turn
    evicts C (not wanted by this call) and B's next turn reuses its prefix: exact counts."""
    engine = _engine(model, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64)
    a, b, c = prompts[0], prompts[1], prompts[3]
    first = engine.generate_turns(
        [
            TurnRequest(ids=a, max_tokens=3, sample_id=0, session="a"),
            TurnRequest(ids=b, max_tokens=5, sample_id=1, session="b"),
        ],
        GREEDY,
    )
    assert first.finish_reasons == ["length", "length"]
    engine.generate_turns([TurnRequest(ids=c, max_tokens=2, sample_id=2, session="c")], GREEDY)
    assert set(engine.sessions._entries) == {"b", "c"}
    a2, b2 = a + first.response_ids[0] + [40], b + first.response_ids[1] + [41]
    engine.generate_turns(
        [
            TurnRequest(ids=a2, max_tokens=2, sample_id=0, position=4, session="a"),
            TurnRequest(ids=b2, max_tokens=2, sample_id=1, position=6, session="b"),
        ],
        GREEDY,
    )
    reused = len(b) + 5 - 1
    assert engine.generation_metrics() == {
        "rollout/prefill_tokens": len(a2) + len(b2) - reused,
        "rollout/prefill_reused_tokens": reused,
    }
    assert set(engine.sessions._entries) == {"a", "b"}


def test_finish_on_eos_and_on_length(model, prompts):
    free, _ = _exchange(_engine(model, eos=[1]), prompts, GREEDY, turns=1, max_tokens=(8,))
    tokens = free[0][1].response_ids
    stop = next(t for t in (tokens[0][2], tokens[2][1], tokens[1][3]) if not all(t in r for r in tokens))
    for settings in ({}, {"use_hf_forward": True}):
        (_, out), *_ = _exchange(
            _engine(model, eos=[stop], **settings), prompts, GREEDY, turns=1, max_tokens=(8,)
        )[0]
        assert set(out.finish_reasons) == {"eos", "length"}
        for response, reason in zip(out.response_ids, out.finish_reasons):
            assert (response[-1] == stop) == (reason == "eos") and stop not in response[:-1]
            assert reason == "eos" or len(response) == 8


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_fallback_path_runs_turns_without_reuse(model, prompts, params):
    """use_hf_forward: the model's own forward over left-padded rows, each with its own limit, sample id and
    position; no reuse (every token counted as prefilled); same samples as the slot-cache path."""
    padded = _engine(model, use_hf_forward=True, chunk_size=3)
    got, counts = _exchange(padded, prompts, params)
    expected, _ = _exchange(_engine(model, max_model_len=128), prompts, params)
    for (requests, a), (_, b), c in zip(got, expected, counts):
        _same(a, b)
        assert c == {
            "rollout/prefill_tokens": sum(len(r.ids) for r in requests),
            "rollout/prefill_reused_tokens": 0,
        }
    one = dataclasses.replace(params, max_tokens=6)
    alone = padded.generate_turns([TurnRequest(ids=prompts[4], max_tokens=6, sample_id=3)], params)
    _same(alone, padded.generate([prompts[4]], one, prompt_offset=3), exact=True)


def test_fixed_shape_decode_path_with_sessions(model, prompts, monkeypatch):
    """enforce_eager=False (compilation replaced by the plain function, as in test_continuous): idle slots of a
    fixed-shape decode step write to the scratch column, so the cached sessions around them stay intact."""
    monkeypatch.setattr(graphs.torch, "compile", lambda fn, **kwargs: fn)
    fixed = _engine(model, enforce_eager=False, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128)
    got, counts = _exchange(fixed, prompts, SAMPLED, only=[[0, 1, 2, 3, 4], [1, 3], [0, 1, 2, 3, 4]])
    expected, _ = _exchange(
        _engine(model), prompts, SAMPLED, only=[[0, 1, 2, 3, 4], [1, 3], [0, 1, 2, 3, 4]], sessions=False
    )
    assert fixed._static is not None
    for (_, a), (_, b) in zip(got, expected):
        _same(a, b)
    assert counts[2]["rollout/prefill_reused_tokens"] > 0


def test_sessions_end_at_sync_release_generate_and_reshape(model, prompts):
    engine = _engine(model, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64)
    request = TurnRequest(ids=prompts[0], max_tokens=4, sample_id=0, session=0)
    out = engine.generate_turns([request], GREEDY)
    follow = TurnRequest(
        ids=prompts[0] + out.response_ids[0] + [40], max_tokens=3, sample_id=0, position=5, session=0
    )

    def reused_after(action):
        engine.generate_turns([request], GREEDY)
        action()
        engine.generate_turns([follow], GREEDY)
        return engine.generation_metrics()["rollout/prefill_reused_tokens"]

    assert reused_after(lambda: None) == len(prompts[0]) + 3
    assert reused_after(lambda: engine.sync_weights([])) == 0
    assert reused_after(lambda: (engine.release_memory(), engine.wake_up())) == 0
    assert reused_after(lambda: engine.generate([prompts[1]], SamplingParams(max_tokens=2))) == 0
    # A turn longer than the cache re-allocates it (doubling its length): the sessions held end.
    longer = TurnRequest(ids=list(range(5, 70)), max_tokens=2, sample_id=9)
    assert reused_after(lambda: engine.generate_turns([longer], GREEDY)) == 0
    assert engine.cache.length == 128


def test_cache_grows_once_for_a_run_with_max_model_len(model, prompts):
    """With max_model_len the cache is allocated at that length on the first turn: no re-allocation later."""
    engine = _engine(model, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=100)
    _exchange(engine, prompts, GREEDY)
    assert engine.cache.generation == 1 and engine.cache.length == 100


def test_bad_requests_are_refused(model, prompts):
    engine = _engine(model)
    for requests, match in (
        ([], "non-empty"),
        ([prompts[0]], "not a TurnRequest"),
        ([TurnRequest(ids=[], max_tokens=2, sample_id=0)], "ids is empty"),
        ([TurnRequest(ids=[5], max_tokens=0, sample_id=0)], "max_tokens=0"),
        ([TurnRequest(ids=[5], max_tokens=2, sample_id=-1)], "sample_id=-1"),
        ([TurnRequest(ids=[5], max_tokens=2, sample_id=0, position=-2)], "position=-2"),
    ):
        with pytest.raises(ValueError, match=match):
            engine.generate_turns(requests, GREEDY)


def test_sliding_window_model_beyond_its_window_runs_turns_on_the_model_forward(prompts):
    """A call whose context exceeds a sliding-window model's window goes to the fallback path (no reuse there);
    within the window, the slot cache. Both give greedy recomputation's tokens."""
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        sliding_window=12,
    )
    model = MistralForCausalLM(config).eval()
    engine = _engine(model, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    short, long = [p for p in prompts if len(p) <= 5], [p for p in prompts if len(p) > 12]
    for batch, reused in ((short, True), (long, False)):
        (first, second), metrics = _exchange(engine, batch, GREEDY, turns=2, max_tokens=(2,))
        for requests, out in (first, second):
            assert out.response_ids == [_greedy(model, r.ids, r.max_tokens) for r in requests]
        assert (metrics[1]["rollout/prefill_reused_tokens"] > 0) == reused


def _greedy(model, ids, max_tokens):
    """Reference: a full forward (no cache) for every new token, argmax, stop on eos (PAD here)."""
    ids, start = list(ids), len(ids)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
            if ids[-1] == PAD:
                break
    return ids[start:]
