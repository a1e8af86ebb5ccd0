"""NativeEngine: greedy parity with HF generate, log-prob correctness, finishing, ordering, seeds, chunking."""

import copy

import pytest
import torch

from posttrain.models.tiny import build_tiny_model
from posttrain.rollout.base import RolloutEngine, SamplingParams
from posttrain.rollout.native import engine as native
from posttrain.rollout.native.engine import NativeEngine, left_pad

EOS, PAD = 2, 0
# Untied embeddings: a random tied model greedily repeats its last input token, which would make tests weak.
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok, seed=0, **SMALL)


@pytest.fixture(scope="module")
def prompts(tok):
    texts = ["What is 1 + 2?", "Hello", "The quick brown fox jumps over the lazy dog and", "Count: 7 8 9"]
    return [tok.encode(t) for t in texts]


def _engine(model, chunk_size=8, eos=(EOS,)):
    return NativeEngine(model, eos_token_ids=list(eos), pad_token_id=PAD, chunk_size=chunk_size)


def _greedy_first_tokens(model, prompts):
    result = _engine(model).generate(prompts, SamplingParams(max_tokens=1, greedy=True))
    return [r[0] for r in result.response_ids]


def test_greedy_matches_hf_generate(model, prompts):
    # Use prompt 1's first greedy token as an extra eos so that one row stops early and the rest continue.
    eos = [EOS, _greedy_first_tokens(model, prompts)[1]]
    result = _engine(model, eos=eos).generate(prompts, SamplingParams(max_tokens=10, greedy=True))
    ids, mask = left_pad(prompts, PAD, torch.device("cpu"))
    hf = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=10,
        eos_token_id=eos,
        pad_token_id=PAD,
    )[:, ids.shape[1] :].tolist()
    for ours, theirs in zip(result.response_ids, hf):
        assert ours == theirs[: len(ours)]
        assert all(t == PAD for t in theirs[len(ours) :])
    assert result.finish_reasons[1] == "eos" and len(result.response_ids[1]) == 1
    assert [len(r) for i, r in enumerate(result.response_ids) if i != 1] == [10, 10, 10]


def _recompute_logprobs(model, prompt, response, temperature):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=8, n=2, temperature=0.7, top_p=0.9, top_k=50, seed=3),
        SamplingParams(max_tokens=8, temperature=1.3, seed=4),
        SamplingParams(max_tokens=8, greedy=True, temperature=0.5),  # greedy reports temperature-1 log-probs
    ],
)
def test_logprobs_equal_full_forward_recomputation(model, prompts, params):
    result = _engine(model).generate(prompts, params)
    temperature = 1.0 if params.greedy else params.temperature
    for i, response, logprobs in zip(result.prompt_index, result.response_ids, result.response_logprobs):
        expected = _recompute_logprobs(model, prompts[i], response, temperature)
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)


def test_finish_reasons_eos_and_length(model, prompts):
    first = _greedy_first_tokens(model, prompts)
    eos = [first[0]]  # prompt 0 stops on its first token
    result = _engine(model, eos=eos).generate(prompts, SamplingParams(max_tokens=5, greedy=True))
    assert result.finish_reasons[0] == "eos" and result.response_ids[0] == [first[0]]
    for i in range(1, len(prompts)):
        ended = result.response_ids[i][-1] in eos
        assert result.finish_reasons[i] == ("eos" if ended else "length")
        assert ended or len(result.response_ids[i]) == 5
        assert len(result.response_logprobs[i]) == len(result.response_ids[i])
    # All rows finishing on their first token stops decoding after one step.
    everyone = _engine(model, eos=first).generate(prompts, SamplingParams(max_tokens=50, greedy=True))
    assert everyone.finish_reasons == ["eos"] * len(prompts)
    assert everyone.response_lengths == [1] * len(prompts)


def test_n_samples_are_prompt_major(model, prompts):
    result = _engine(model, chunk_size=3).generate(prompts, SamplingParams(max_tokens=6, n=3, seed=0))
    assert result.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert len(result) == 12 and all(len(r) == 6 for r in result.response_ids)
    samples_of_prompt_0 = {tuple(r) for r in result.response_ids[:3]}
    assert len(samples_of_prompt_0) > 1  # the n copies are sampled independently


def test_seeded_reproducibility(model, prompts):
    engine = _engine(model)
    params = SamplingParams(max_tokens=8, n=2, top_p=0.95, seed=123)
    torch.manual_seed(0)
    a = engine.generate(prompts, params)
    torch.manual_seed(999)  # the global RNG must not matter
    b = engine.generate(prompts, params)
    c = engine.generate(prompts, SamplingParams(max_tokens=8, n=2, top_p=0.95, seed=124))
    assert a.response_ids == b.response_ids and a.response_logprobs == b.response_logprobs
    assert a.response_ids != c.response_ids


def test_chunk_size_bounds_prompts_in_flight(model, prompts, monkeypatch):
    running = []
    real_forward = native.forward_step

    def record(parts, k, v, inputs):
        running.append(inputs.num_decode)
        return real_forward(parts, k, v, inputs)

    monkeypatch.setattr(native, "forward_step", record)
    chunked = _engine(model, chunk_size=1).generate(prompts, SamplingParams(max_tokens=4, n=3, greedy=True))
    assert max(running) == 3  # one prompt at a time: its 3 samples
    whole = _engine(model, chunk_size=64).generate(prompts, SamplingParams(max_tokens=4, n=3, greedy=True))
    assert chunked.response_ids == whole.response_ids
    assert chunked.prompt_index == whole.prompt_index


def test_top_k_1_equals_greedy(model, prompts):
    engine = _engine(model)
    greedy = engine.generate(prompts, SamplingParams(max_tokens=8, greedy=True))
    top1 = engine.generate(prompts, SamplingParams(max_tokens=8, top_k=1, seed=5))
    assert top1.response_ids == greedy.response_ids
    for a, b in zip(top1.response_logprobs, greedy.response_logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


def test_restores_training_mode(model, prompts):
    model.train()
    try:
        _engine(model).generate(prompts[:1], SamplingParams(max_tokens=2, seed=0))
        assert model.training
    finally:
        model.eval()
    _engine(model).generate(prompts[:1], SamplingParams(max_tokens=2, seed=0))
    assert not model.training


def test_sync_weights_own_copy_and_shared(tok, prompts):
    policy = build_tiny_model(tok, seed=1, **SMALL)
    engine = _engine(copy.deepcopy(policy))
    assert isinstance(engine, RolloutEngine)
    params = SamplingParams(max_tokens=6, greedy=True)
    with torch.no_grad():  # a "policy update" touching a subset of weights
        policy.lm_head.weight.mul_(-1.0)
        policy.model.layers[1].mlp.down_proj.weight.add_(0.5)
    stale = engine.generate(prompts, params)
    engine.sync_weights(
        (n, p.detach()) for n, p in policy.named_parameters() if "lm_head" in n or "layers.1." in n
    )
    fresh = engine.generate(prompts, params)
    expected = _engine(policy).generate(prompts, params)
    assert fresh.response_ids == expected.response_ids != stale.response_ids

    shared = _engine(policy)
    before = policy.lm_head.weight.clone()
    shared.sync_weights(policy.named_parameters())  # same tensors: nothing to copy
    assert torch.equal(policy.lm_head.weight, before)

    with pytest.raises(ValueError, match="not_a_weight"):
        engine.sync_weights([("not_a_weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.sync_weights([("lm_head.weight", torch.zeros(3, 3))])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 4, "n": 0}, "n"),
        ({"max_tokens": 4, "temperature": 0.0}, "temperature"),
        ({"max_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_tokens": 4, "top_p": 1.5}, "top_p"),
        ({"max_tokens": 4, "top_k": 0}, "top_k"),
        ({"max_tokens": 4, "seed": -1}, "seed"),
        ({"max_tokens": 4, "n": True}, "n"),
    ],
)
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        SamplingParams(**kwargs)


def test_invalid_engine_arguments(model):
    with pytest.raises(ValueError, match="eos_token_ids"):
        NativeEngine(model, eos_token_ids=[], pad_token_id=PAD)
    with pytest.raises(ValueError, match="chunk_size"):
        NativeEngine(model, eos_token_ids=[EOS], pad_token_id=PAD, chunk_size=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        NativeEngine(model, eos_token_ids=[EOS], pad_token_id=PAD, max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens=8 must be >= max_num_seqs=16"):
        NativeEngine(model, eos_token_ids=[EOS], pad_token_id=PAD, max_num_seqs=16, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="prompt_offset"):
        _engine(model).generate([[5]], SamplingParams(max_tokens=2), prompt_offset=-1)
    with pytest.raises(ValueError, match="prompt_ids"):
        _engine(model).generate([], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"prompt_ids\[1\]"):
        _engine(model).generate([[5], []], SamplingParams(max_tokens=2))


def test_cuda_generation_leaves_cudnn_attention_out():
    """On CUDA the engine generates with sdpa's cuDNN backend off (a new plan per decode length); on CPU the
    context does nothing. The flags are process-wide, so this runs without a GPU."""
    from posttrain.rollout.native.decoder import attention_backends

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with attention_backends(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with attention_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
