"""VLLMEngine.generate_turns: a turn at position 0 is what ``generate`` samples, later turns of a session reuse the
earlier turns' cached keys/values, and the sampled tokens' log-probs over a whole multi-turn sequence are the
trainer's recomputation (environment tokens, mask 0, are skipped).

Runs in the vLLM environment only (``pytest -m vllm``): one fp32 engine for the module, on a tiny Qwen2 whose head
size (32) vLLM's CPU attention supports.
"""

import os

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from posttrain.models.tiny import build_tiny_model  # noqa: E402
from posttrain.rollout.base import SamplingParams, TurnEngine, TurnRequest  # noqa: E402
from posttrain.rollout.vllm import VLLMEngine, VLLMKnobs, sample_seed, turn_seed  # noqa: E402

EOS = 2
SHAPE = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "tie_word_embeddings": False,
}
# Long enough that a turn's context spans whole KV-cache blocks (only whole blocks are reused).
TEXTS = [
    "Let us play a game of numbers. " * 12 + "What is 1 + 2?",
    "Tell me a story about a fox and a dog, with many turns. " * 8,
]
REPLY = " Okay. Go on, and say a little more please."  # the environment's fixed reply after each turn


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    model = build_tiny_model(tok, seed=0, **SHAPE)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # clear gaps between tokens: samples do not flip on rounding
    path = tmp_path_factory.mktemp("vllm_turns")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model_dir):
    knobs = VLLMKnobs(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024, load_format="auto")
    eng = VLLMEngine(model_dir, [EOS], dtype="fp32", seed=0, knobs=knobs)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(t) for t in TEXTS]


def test_turn_seed_position_zero_is_the_sample_seed():
    assert turn_seed(7, 5, 0) == sample_seed(7, 5)
    seeds = {turn_seed(7, s, p) for s in range(4) for p in (0, 1, 30, 31)}
    assert len(seeds) == 16 and all(0 <= x < 2**63 for x in seeds)


def test_position_zero_matches_generate(engine, prompts):
    assert isinstance(engine, TurnEngine)
    params = SamplingParams(max_tokens=24, n=2, temperature=1.0, seed=5)
    whole = engine.generate(prompts, params, prompt_offset=3)  # sample ids 6, 7, 8, 9
    requests = [TurnRequest(prompts[k // 2], 24, sample_id=6 + k, session=k) for k in range(4)]
    for session in (True, False):
        if not session:
            requests = [TurnRequest(r.ids, r.max_tokens, r.sample_id) for r in requests]
        turns = engine.generate_turns(requests, SamplingParams(max_tokens=1, temperature=1.0, seed=5))
        assert turns.prompt_index == [0, 1, 2, 3]
        assert turns.response_ids == whole.response_ids
        assert turns.finish_reasons == whole.finish_reasons
        for a, b in zip(turns.response_logprobs, whole.response_logprobs):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    assert engine.generation_metrics()["rollout/prefill_reused_tokens"] == 0  # session=None reads no cache


def _three_turns(engine, prompts, reply, params, sessions: bool):
    """Each prompt's 3-turn exchange: assistant turn, the environment's fixed reply (mask 0), ... Returns the
    responses (ids, log-probs, masks; log-prob 0 on reply tokens) and the metrics of each turn."""
    ids = [[] for _ in prompts]
    logprobs = [[] for _ in prompts]
    masks = [[] for _ in prompts]
    metrics = []
    for turn in range(3):
        requests = [
            TurnRequest(
                p + r, max_tokens=10 + 4 * turn, sample_id=s, position=len(r), session=s if sessions else None
            )
            for s, (p, r) in enumerate(zip(prompts, ids))
        ]
        out = engine.generate_turns(requests, params)
        metrics.append(engine.generation_metrics())
        for s in range(len(prompts)):
            got = out.response_ids[s]
            assert 1 <= len(got) <= requests[s].max_tokens
            ids[s] += got + reply
            logprobs[s] += out.response_logprobs[s] + [0.0] * len(reply)
            masks[s] += [1] * len(got) + [0] * len(reply)
    return ids, logprobs, masks, metrics


def test_three_turns_reuse_prefix_and_match_trainer_logprobs(engine, hf_model, prompts, tok):
    reply = tok.encode(REPLY)
    params = SamplingParams(max_tokens=1, temperature=0.8, seed=11)
    ids, logprobs, masks, metrics = _three_turns(engine, prompts, reply, params, sessions=True)
    for turn in (1, 2):  # each later turn extends the previous context: its blocks are read from the cache
        assert metrics[turn]["rollout/prefill_reused_tokens"] > 0, metrics
        assert metrics[turn]["rollout/prefill_tokens"] > 0
    # Without sessions: the same samples (same seeds), every context token computed again.
    ids2, logprobs2, _, metrics2 = _three_turns(engine, prompts, reply, params, sessions=False)
    assert ids2 == ids
    assert all(m["rollout/prefill_reused_tokens"] == 0 for m in metrics2)
    assert sum(m["rollout/prefill_tokens"] for m in metrics2) > sum(
        m["rollout/prefill_tokens"] for m in metrics
    )
    # The trainer's recomputation over prompt + the whole multi-turn response, at the sampled tokens only.
    worst = 0.0
    for prompt, response, lps, mask in zip(prompts, ids, logprobs, masks):
        seq = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = hf_model(seq, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits / params.temperature, -1).gather(-1, seq[0, len(prompt) :, None])[
            :, 0
        ]
        keep = torch.tensor(mask, dtype=torch.bool)
        assert keep.sum() > 0 and (~keep).sum() == 3 * len(reply)
        worst = max(worst, (torch.tensor(lps)[keep] - expected[keep]).abs().max().item())
    assert worst <= 1e-5


def test_release_memory_ends_sessions(engine, prompts):
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=2)
    request = [TurnRequest(prompts[0], 4, sample_id=0, session=0)]
    first = engine.generate_turns(request, params)
    again = engine.generate_turns(request, params)
    assert engine.generation_metrics()["rollout/prefill_reused_tokens"] > 0
    engine.release_memory()  # sessions end here: the cache is emptied (on CPU; CUDA sleep drops it too)
    engine.wake_up()
    third = engine.generate_turns(request, params)
    assert engine.generation_metrics()["rollout/prefill_reused_tokens"] == 0
    assert first.response_ids == again.response_ids == third.response_ids


def test_turn_requests_are_checked(engine, prompts):
    params = SamplingParams(max_tokens=1, seed=0)
    with pytest.raises(ValueError, match="requests is empty"):
        engine.generate_turns([], params)
    with pytest.raises(ValueError, match=r"requests\[0\].max_tokens=0"):
        engine.generate_turns([TurnRequest(prompts[0], 0, sample_id=0)], params)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate_turns([TurnRequest(prompts[0], 1000, sample_id=0)], params)
