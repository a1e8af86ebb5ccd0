"""VLLMEngine against the trainer's model: greedy parity with the native engine, log-probs equal to the trainer's,
samples independent of batching, weight sync, fused-group safety, LoRA (merged and adapter-only).

Runs in the vLLM environment only (``pytest -m vllm``): one engine for the module, fp32, on a tiny Qwen2 whose
head size (32) vLLM's CPU attention supports.
"""

import copy
import os

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from posttrain.config.schema import RolloutConfig  # noqa: E402
from posttrain.models.tiny import build_tiny_model  # noqa: E402
from posttrain.rollout.base import SamplingParams  # noqa: E402
from posttrain.rollout.native.engine import NativeEngine  # noqa: E402
from posttrain.rollout.vllm.factory import build_vllm_engine  # noqa: E402
from posttrain.rollout.vllm.lora_sync import AdapterDirs, sync_policy  # noqa: E402

EOS, PAD = 2, 0
# Head size 128 / 4 = 32. Untied embeddings and a sharpened LM head: clear argmax gaps, so greedy parity is a
# strong test rather than a coin flip between nearly tied tokens of a random model.
SHAPE = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "tie_word_embeddings": False,
}
TEXTS = ["What is 1 + 2?", "Hello", "The quick brown fox jumps over the lazy dog and", "Count: 7 8 9"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    model = build_tiny_model(tok, seed=0, **SHAPE)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("vllm_tiny")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model_dir, hf_model, tok):
    """Built as the trainer builds it (config section -> factory), adapter-serving (LoRA rank 8, not merged), with
    dummy (random) weights as verl's default: the first full sync loads the policy."""
    cfg = RolloutConfig(
        max_num_seqs=16,
        max_num_batched_tokens=256,
        load_format="dummy",
        disable_log_stats=False,
        update_weights_bucket_megabytes=1,
    )
    eng = build_vllm_engine(
        model_dir,
        tok,
        cfg,
        "fp32",
        0,
        "cpu",
        max_prompt_length=64,
        max_response_length=192,
        lora_rank=8,
        lora_merge=False,
        eos_token_ids=[EOS],
    )
    assert eng.knobs.max_model_len == 256 and not eng.knobs.enable_chunked_prefill  # turned off on CPU
    assert eng.knobs.enable_lora and eng.knobs.bucket_bytes == 1 << 20
    assert eng.needs_full_sync
    with pytest.raises(ValueError, match="load_format=dummy"):
        eng.generate([[5, 6]], SamplingParams(max_tokens=2, greedy=True))
    eng.sync_weights(hf_model.state_dict().items())
    assert not eng.needs_full_sync
    return eng


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(t) for t in TEXTS]


def _native(model, eos=(EOS,)):
    return NativeEngine(model, eos_token_ids=list(eos), pad_token_id=PAD, chunk_size=8)


def _greedy(engine, prompts, max_tokens=12):
    return engine.generate(prompts, SamplingParams(max_tokens=max_tokens, greedy=True))


def test_greedy_matches_native_engine(engine, hf_model, prompts):
    stop = _greedy(_native(hf_model), prompts, max_tokens=1).response_ids[1][0]  # prompt 1 ends at once
    engine.eos_token_ids = [EOS, stop]
    try:
        ours = _greedy(engine, prompts)
    finally:
        engine.eos_token_ids = [EOS]
    theirs = _greedy(_native(hf_model, eos=(EOS, stop)), prompts)
    assert ours.response_ids == theirs.response_ids
    assert ours.finish_reasons == theirs.finish_reasons
    assert ours.finish_reasons[1] == "eos" and ours.response_ids[1] == [stop]
    assert ours.prompt_index == [0, 1, 2, 3]
    for a, b in zip(ours.response_logprobs, theirs.response_logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def _trainer_logprobs(model, prompt, response, temperature):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=10, n=2, temperature=0.7, seed=3),
        SamplingParams(max_tokens=10, temperature=1.3, seed=4),
        SamplingParams(max_tokens=10, greedy=True, temperature=0.5),  # greedy reports temperature-1 log-probs
    ],
)
def test_logprobs_equal_trainer_recomputation(engine, hf_model, prompts, params):
    assert engine.logprobs_match_trainer(params)
    result = engine.generate(prompts, params)
    temperature = 1.0 if params.greedy else params.temperature
    worst = 0.0
    for k, (response, logprobs) in enumerate(zip(result.response_ids, result.response_logprobs)):
        expected = _trainer_logprobs(hf_model, prompts[result.prompt_index[k]], response, temperature)
        worst = max(worst, (torch.tensor(logprobs) - expected).abs().max().item())
    assert worst <= 1e-5


def test_topk_topp_logprobs_are_flagged(engine):
    assert not engine.logprobs_match_trainer(SamplingParams(max_tokens=4, top_k=20))
    assert not engine.logprobs_match_trainer(SamplingParams(max_tokens=4, top_p=0.9))


def test_samples_independent_of_batching(engine, prompts):
    params = SamplingParams(max_tokens=10, n=3, temperature=1.0, seed=7)
    whole = engine.generate(prompts, params)
    first = engine.generate(prompts[:1], params, prompt_offset=0)
    rest = engine.generate(prompts[1:], params, prompt_offset=1)
    assert first.response_ids + rest.response_ids == whole.response_ids
    assert rest.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # local to the call
    # Fewer sequences at once (what a smaller max_num_seqs does): the scheduler's admission limit, lowered.
    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
    saved = scheduler.max_num_active_reqs
    scheduler.max_num_active_reqs = 2
    try:
        narrow = engine.generate(prompts, params)
    finally:
        scheduler.max_num_active_reqs = saved
    assert narrow.response_ids == whole.response_ids
    other_seed = engine.generate(prompts, SamplingParams(max_tokens=10, n=3, temperature=1.0, seed=8))
    assert other_seed.response_ids != whole.response_ids


def test_on_sample_reports_each_request_as_vllm_finishes_it(engine, prompts):
    """Each sample once, equal to its entry of the result, while other requests are still unfinished; the samples
    are those of a call without the callback."""
    params = SamplingParams(max_tokens=10, n=3, temperature=1.0, seed=7)
    whole = engine.generate(prompts, params)
    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
    saved = scheduler.max_num_active_reqs
    scheduler.max_num_active_reqs = 2  # requests finish over several steps
    seen = {}

    def on_sample(index, sample):
        assert index not in seen
        seen[index] = (sample, engine.llm.llm_engine.has_unfinished_requests())

    try:
        reported = engine.generate(prompts, params, on_sample=on_sample)
    finally:
        scheduler.max_num_active_reqs = saved
    assert reported == whole
    assert sorted(seen) == list(range(len(whole)))
    for index, (sample, _) in seen.items():
        assert sample == whole.subset([index])
    assert sum(unfinished for _, unfinished in seen.values()) >= len(whole) - 2  # most while others ran
    assert engine.generation_metrics()["rollout/tokens_per_s"] > 0


def test_a_callback_that_raises_leaves_no_request_behind(engine, prompts):
    params = SamplingParams(max_tokens=10, n=2, temperature=1.0, seed=5)

    def fail(index, sample):
        raise RuntimeError("scoring failed")

    with pytest.raises(RuntimeError, match="scoring failed"):
        engine.generate(prompts, params, on_sample=fail)
    assert not engine.llm.llm_engine.has_unfinished_requests()
    assert engine.generate(prompts, params) == engine.generate(prompts, params, on_sample=lambda i, s: None)


def test_sync_after_update_matches_trainer(engine, hf_model, prompts):
    trained = copy.deepcopy(hf_model)
    opt = torch.optim.SGD(trained.parameters(), lr=0.5)
    ids = torch.tensor([prompts[2]])
    for _ in range(3):  # a few steps of next-token loss: every weight changes
        loss = trained(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    trained.eval()
    before = _greedy(engine, prompts).response_ids
    expected = _greedy(_native(trained), prompts).response_ids
    assert expected != before
    try:
        engine.sync_weights(trained.state_dict().items())
        metrics = engine.sync_metrics()
        assert metrics["rollout/sync_bytes"] == sum(t.numel() * 4 for t in trained.state_dict().values())
        assert metrics["rollout/sync_buckets"] > 1  # 1 MiB buckets, 1.7 MiB of weights
        assert _greedy(engine, prompts).response_ids == expected
    finally:
        engine.sync_weights(hf_model.state_dict().items())
    assert _greedy(engine, prompts).response_ids == before


def test_partial_group_push_raises_and_loads_nothing(engine, hf_model, prompts):
    before = _greedy(engine, prompts).response_ids
    state = hf_model.state_dict()
    for partial in (["model.layers.0.self_attn.q_proj.weight"],
                    ["model.layers.1.mlp.up_proj.weight"],
                    ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                     "model.layers.0.self_attn.v_proj.weight"]):  # fmt: skip  # biases missing
        with pytest.raises(ValueError, match="missing"):
            engine.sync_weights((name, torch.randn_like(state[name])) for name in partial)
    with pytest.raises(ValueError, match="not a tensor of the engine's checkpoint"):
        engine.sync_weights([("model.layers.0.nope.weight", torch.zeros(1))])
    assert _greedy(engine, prompts).response_ids == before


def test_release_and_wake_up_are_noops_on_cpu(engine, prompts):
    before = _greedy(engine, prompts).response_ids
    engine.release_memory()
    engine.wake_up()
    engine.release_memory()  # generate wakes the engine itself when needed
    assert _greedy(engine, prompts).response_ids == before


def test_generation_metrics(engine, prompts):
    engine.generate(prompts, SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=1))
    metrics = engine.generation_metrics()
    assert metrics["rollout/tokens_per_s"] > 0
    assert metrics["rollout/vllm_generation_tokens"] > 0


def _lora_policy(hf_model, seed):
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(
        copy.deepcopy(hf_model), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return policy.eval()


def test_lora_merged_and_adapter_only_match_trainer(engine, hf_model, prompts, tmp_path):
    pytest.importorskip("peft")
    base = _greedy(engine, prompts).response_ids
    policy = _lora_policy(hf_model, seed=1)
    expected = _greedy(_native(policy), prompts).response_ids
    assert expected != base
    try:
        sync_policy(engine, policy, merge=True)
        assert _greedy(engine, prompts).response_ids == expected
        engine.sync_weights(hf_model.state_dict().items())  # back to the base under the adapter
        dirs = AdapterDirs(tmp_path)
        sync_policy(engine, policy, merge=False, dirs=dirs)
        assert _greedy(engine, prompts).response_ids == expected
        policy2 = _lora_policy(hf_model, seed=2)  # the next "step": new adapter values, new LoRA id
        sync_policy(engine, policy2, merge=False, dirs=dirs)
        assert _greedy(engine, prompts).response_ids == _greedy(_native(policy2), prompts).response_ids
    finally:
        engine.clear_lora_adapter()
        engine.sync_weights(hf_model.state_dict().items())
    assert _greedy(engine, prompts).response_ids == base
