"""Continuous batching over the slot KV cache: parity with plain recomputation, batch invariance, cache life."""

import copy

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from posttrain.models.tiny import build_tiny_model
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import graphs
from posttrain.rollout.native.engine import NativeEngine

PAD = 0
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "tie_word_embeddings": False}
ARCH = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    tie_word_embeddings=False,
)


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
        "Count: 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22",
        "Hello there",
    ]
    return [tok.encode(t) for t in texts]  # ragged: 1 to ~30 tokens


def _engine(model, eos, **kwargs):
    return NativeEngine(model, eos_token_ids=list(eos), pad_token_id=PAD, **kwargs)


def greedy_by_recomputation(model, prompts, max_tokens, eos):
    """Reference: per prompt, no padding, no cache: a full forward for every new token, argmax."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
                if ids[-1] in eos:
                    break
            out.append(ids[len(prompt) :])
    return out


def _eos_that_stops_some(model, prompts, max_tokens):
    """A token that greedy decoding emits early for some prompts but not for all (so rows stop at different
    steps)."""
    free = greedy_by_recomputation(model, prompts, max_tokens, eos=set())
    for token in (free[0][2], free[2][1], free[4][3]):
        stops = [token in r for r in free]
        if any(stops) and not all(stops):
            return token
    raise AssertionError("no token that stops only some prompts")


@pytest.mark.parametrize(
    "settings",
    [
        {},  # defaults: everything in one wave
        {"max_num_seqs": 2, "max_num_batched_tokens": 3},  # one-token prefill chunks next to decoding
        {"max_num_seqs": 3, "max_num_batched_tokens": 7, "chunk_size": 2},
        {"max_num_seqs": 4, "max_num_batched_tokens": 64, "enable_chunked_prefill": False},
        {"max_num_seqs": 1, "max_num_batched_tokens": 1},  # one sequence at a time; samples take over slots
    ],
)
def test_greedy_equals_recomputation(model, prompts, settings):
    eos = {_eos_that_stops_some(model, prompts, 10)}
    expected = greedy_by_recomputation(model, prompts, 10, eos)
    result = _engine(model, eos, **settings).generate(
        prompts, SamplingParams(max_tokens=10, n=2, greedy=True)
    )
    # n=2 greedy samples are equal: the second one reads the prompt's keys copied from the first one's slot.
    assert result.response_ids == [r for r in expected for _ in range(2)]
    assert result.finish_reasons == ["eos" if r[-1] in eos else "length" for r in expected for _ in range(2)]
    assert {len(r) for r in result.response_ids} != {10}  # some rows did stop early


@pytest.mark.parametrize(
    "build",
    [
        lambda: LlamaForCausalLM(LlamaConfig(**ARCH, attention_bias=True)),
        lambda: Qwen3ForCausalLM(Qwen3Config(**ARCH, head_dim=32)),  # q/k norms, head_dim != hidden / heads
    ],
    ids=["llama", "qwen3"],
)
def test_other_decoder_families_equal_recomputation(prompts, build):
    torch.manual_seed(0)
    model = build().eval()
    engine = _engine(model, {PAD}, max_num_seqs=3, max_num_batched_tokens=8)
    assert not engine.use_hf_forward
    result = engine.generate(prompts, SamplingParams(max_tokens=6, greedy=True))
    assert result.response_ids == greedy_by_recomputation(model, prompts, 6, {PAD})


def test_sliding_window_model_uses_the_model_forward_beyond_its_window(prompts):
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**ARCH, sliding_window=12)).eval()
    engine = _engine(model, {PAD}, max_num_seqs=3, max_num_batched_tokens=8)
    assert not engine.use_hf_forward
    short, long = [p for p in prompts if len(p) <= 6], [p for p in prompts if len(p) > 12]
    params = SamplingParams(max_tokens=6, greedy=True)
    assert not engine._beyond_window(short, params) and engine._beyond_window(long, params)
    # Within the window: the slot cache; beyond it: the model's own sliding-window forward.
    for batch in (short, long):
        assert engine.generate(batch, params).response_ids == greedy_by_recomputation(model, batch, 6, {PAD})


def test_lora_wrapped_policy(model, prompts):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    wrapped = peft.get_peft_model(copy.deepcopy(model), config).eval()
    engine = _engine(wrapped, {2})
    assert not engine.use_hf_forward
    result = engine.generate(prompts, SamplingParams(max_tokens=6, greedy=True))
    assert result.response_ids == greedy_by_recomputation(wrapped, prompts, 6, {2})
    assert result.response_ids != greedy_by_recomputation(model, prompts, 6, {2})  # the adapters matter


def test_unsupported_architecture_uses_the_model_forward(prompts):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4)).eval()
    engine = _engine(model, {PAD})
    assert engine.use_hf_forward
    result = engine.generate(prompts, SamplingParams(max_tokens=5, greedy=True))
    assert result.response_ids == greedy_by_recomputation(model, prompts, 5, {PAD})
    with pytest.raises(ValueError, match="gpt2"):
        _engine(model, {PAD}, use_hf_forward=False)


SAMPLED = SamplingParams(max_tokens=8, n=3, temperature=1.2, top_p=0.95, top_k=100, seed=17)


def _same_samples(a, b):
    assert a.response_ids == b.response_ids
    assert a.finish_reasons == b.finish_reasons
    for x, y in zip(a.response_logprobs, b.response_logprobs):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=2e-5, rtol=0)


def test_samples_do_not_depend_on_batching(model, prompts):
    eos = {2, 3}
    reference = _engine(model, eos).generate(prompts, SAMPLED)
    assert len({tuple(r) for r in reference.response_ids[:3]}) > 1  # a prompt's samples differ
    for settings in (
        {"max_num_seqs": 2, "max_num_batched_tokens": 3},
        {"max_num_seqs": 5, "max_num_batched_tokens": 9, "chunk_size": 1},
        {"max_num_seqs": 4, "max_num_batched_tokens": 64, "enable_chunked_prefill": False},
        {"use_hf_forward": True, "chunk_size": 4},  # the fallback path draws the same noise
    ):
        _same_samples(_engine(model, eos, **settings).generate(prompts, SAMPLED), reference)


def test_prompt_offset_splits_equal_one_call(model, prompts):
    """Data-parallel ranks generating slices of the prompts with prompt_offset get one process's samples."""
    eos = {2, 3}
    whole = _engine(model, eos).generate(prompts, SAMPLED)
    engine = _engine(model, eos, max_num_seqs=4, max_num_batched_tokens=16)
    parts = [engine.generate(prompts[a:b], SAMPLED, prompt_offset=a) for a, b in ((0, 1), (1, 4), (4, 6))]
    for part in parts:
        assert part.prompt_index == [i for i in range(len(part) // 3) for _ in range(3)]  # local indices
    joined = parts[0]
    for part in parts[1:]:
        joined.response_ids += part.response_ids
        joined.response_logprobs += part.response_logprobs
        joined.finish_reasons += part.finish_reasons
    _same_samples(joined, whole)
    # Without the offset a slice replays the first prompts' randomness: different samples.
    shifted = engine.generate(prompts[1:4], SAMPLED)
    assert shifted.response_ids != whole.response_ids[3:12]


def _recompute_logprobs(model, prompt, response, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response]), use_cache=False).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, torch.tensor(response)[:, None])[
        :, 0
    ]


def test_logprobs_match_recomputation_with_chunked_prefill(model, prompts):
    params = SamplingParams(max_tokens=8, n=2, temperature=0.8, top_p=0.9, seed=3)
    result = _engine(model, {2}, max_num_seqs=3, max_num_batched_tokens=5).generate(prompts, params)
    for i, response, logprobs in zip(result.prompt_index, result.response_ids, result.response_logprobs):
        expected = _recompute_logprobs(model, prompts[i], response, 0.8)
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)


def test_first_tokens_follow_the_model_distribution(model, prompts, chi_square):
    """Many samples of one prompt: first-token counts against the softmax of a plain forward (chi-square)."""
    peaked = copy.deepcopy(model)  # a random model is near-uniform; sharpen it so that the test has power
    with torch.no_grad():
        peaked.lm_head.weight.mul_(10.0)
        logits = peaked(torch.tensor(prompts[:1])).logits[0, -1]
    n = 4000
    for temperature in (0.7, 1.0):
        params = SamplingParams(max_tokens=1, n=n, temperature=temperature, seed=1)
        result = _engine(peaked, {2}).generate(prompts[:1], params)
        counts = torch.bincount(torch.tensor([r[0] for r in result.response_ids]), minlength=logits.shape[0])
        stat, critical = chi_square(counts, torch.softmax(logits / temperature, -1))
        assert stat < critical, (temperature, stat, critical)
    stat, critical = chi_square(counts, torch.softmax(logits / 0.7, -1))  # the test tells temperatures apart
    assert stat > 3 * critical


def test_cache_is_reused_across_calls_and_after_sync_weights(tok, prompts):
    policy = build_tiny_model(tok, seed=1, **SMALL)
    engine = _engine(policy, {2}, own_copy=True, max_num_seqs=8, max_num_batched_tokens=32)
    assert engine.model is not policy
    params = SamplingParams(max_tokens=6, n=2, seed=4)
    first = engine.generate(prompts, params)
    buffer, generation = engine.cache.k[0].data_ptr(), engine.cache.generation
    assert engine.generate(prompts[:2], params).response_ids == first.response_ids[:4]  # smaller: same buffer
    assert engine.cache.k[0].data_ptr() == buffer
    with torch.no_grad():
        policy.lm_head.weight.mul_(-1.0)
    engine.sync_weights(policy.state_dict().items())
    fresh = engine.generate(prompts, params)
    assert (engine.cache.k[0].data_ptr(), engine.cache.generation) == (buffer, generation)
    expected = _engine(policy, {2}, max_num_seqs=8, max_num_batched_tokens=32).generate(prompts, params)
    assert fresh.response_ids == expected.response_ids != first.response_ids
    engine.generate(prompts, SamplingParams(max_tokens=40, seed=4))  # a longer context grows the cache
    assert engine.cache.generation == generation + 1 and engine.cache.length >= max(map(len, prompts)) + 39


def test_release_memory_and_wake_up(model, prompts):
    engine = _engine(model, {2}, max_num_seqs=8, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=5, n=2, seed=9)
    before = engine.generate(prompts, params)
    shape = engine.cache.k[0].shape
    engine.release_memory()
    assert engine.cache.k is None and engine.cache.v is None
    engine.wake_up()
    assert engine.cache.k[0].shape == shape
    engine.release_memory()
    assert engine.generate(prompts, params).response_ids == before.response_ids  # re-allocated on demand


def test_fixed_shape_decode_path(model, prompts, monkeypatch):
    """enforce_eager=False: decode-only steps at bucketed shapes (slots and key length padded, idle slots
    writing to the scratch column) give the eager results. Compilation itself is replaced by the plain
    function here (inductor takes minutes on 2 cores); the benchmark times the compiled path."""
    monkeypatch.setattr(graphs.torch, "compile", lambda fn, **kwargs: fn)
    eos = {_eos_that_stops_some(model, prompts, 10)}
    eager = _engine(model, eos, max_num_seqs=11, max_num_batched_tokens=12)
    fixed = _engine(model, eos, max_num_seqs=11, max_num_batched_tokens=12, enforce_eager=False)
    greedy = SamplingParams(max_tokens=10, n=2, greedy=True)
    assert fixed.generate(prompts, greedy).response_ids == eager.generate(prompts, greedy).response_ids
    assert fixed._static is not None  # the fixed-shape path did run
    _same_samples(fixed.generate(prompts, SAMPLED), eager.generate(prompts, SAMPLED))


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_cache_holds_the_slots_a_call_can_use(model, prompts, monkeypatch, enforce_eager):
    """The cache gets as many slots as the call has samples (rounded up to a power of two, at most
    max_num_seqs), not max_num_seqs: results equal those with every slot allocated, bit for bit, on the eager
    and the fixed-shape path; a larger call grows it."""
    monkeypatch.setattr(graphs.torch, "compile", lambda fn, **kwargs: fn)
    eos = {_eos_that_stops_some(model, prompts, 10)}

    def engine():
        return _engine(model, eos, max_num_seqs=64, max_num_batched_tokens=64, enforce_eager=enforce_eager)

    small, full = engine(), engine()
    full.cache.ensure(full._parts(), 64, 1)  # every slot, as before the cache followed the call
    for params, slots in ((SamplingParams(max_tokens=10, n=2, greedy=True), 8), (SAMPLED, 16)):
        got, expected = small.generate(prompts[:3], params), full.generate(prompts[:3], params)
        assert small.cache.slots == slots < full.cache.slots == 64
        assert got.response_ids == expected.response_ids and got.finish_reasons == expected.finish_reasons
        assert got.response_logprobs == expected.response_logprobs
    small.generate(prompts, SAMPLED)  # 18 samples
    assert small.cache.slots == 32
