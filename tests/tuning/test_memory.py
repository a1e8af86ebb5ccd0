"""The memory estimator's formulas, explain's estimate output and JSON, advice, starting points (no GPU)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from posttrain.cli import main
from posttrain.config.load import build_config
from posttrain.config.plan import build_plan
from posttrain.tuning.advice import advise, check_starting_point, starting_point
from posttrain.tuning.memory import Cluster, WhatIf, estimate_memory
from posttrain.tuning.shape import GIB, ModelShape

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "model_configs"
QWEN_72B = str(CONFIGS / "qwen2.5-72b")
QWEN_7B = str(CONFIGS / "qwen2.5-7b")
# Seed 002's Qwen2.5-72B reference (verl): 64 prompts x n=5, prompt + response within max_model_len 1536.
SEED_002 = ["data.train_batch_size=64", "rollout.n=5", "data.max_prompt_length=512", "data.max_response_length=1024",
            "model.dtype=bf16", "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size_per_gpu=1",
            "actor.log_prob_micro_batch_size_per_gpu=2", "rollout.chunk_size=16"]  # fmt: skip
SEED_002_WHAT_IF = ["--fsdp-size", "8", "--lora-rank", "32", "--param-offload", "--optimizer-offload",
                    "--rollout-engine", "vllm", "--gpu-memory-utilization", "0.4", "--rollout-tp", "8",
                    "--max-num-seqs", "64"]  # fmt: skip
# A 7B GRPO run (seed 004's medium model on 8 GPUs: 256 prompts x 8, 64 samples = 8 prompts per update).
GRPO_7B = ["data.train_batch_size=256", "rollout.n=8", "actor.ppo_mini_batch_size=8", "data.max_prompt_length=512",
           "data.max_response_length=1024", "model.dtype=bf16", "actor.ppo_micro_batch_size_per_gpu=1",
           "actor.log_prob_micro_batch_size_per_gpu=2", "model.enable_gradient_checkpointing=true",
           "actor.entropy_from_logits_with_chunking=true", "actor.entropy_checkpointing=true",
           "rollout.chunk_size=16"]  # fmt: skip


@pytest.mark.parametrize("path", [QWEN_72B, QWEN_7B])
def test_parameter_count_is_exact_for_the_real_architectures(path):
    shape = ModelShape.from_path(path)
    with torch.device("meta"):  # no memory: only shapes
        model = Qwen2ForCausalLM(Qwen2Config(**json.loads((Path(path) / "config.json").read_text())))
    assert shape.num_params() == sum(p.numel() for p in model.parameters())


def test_parameter_count_tiny_tied():
    cfg = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    assert ModelShape.from_hf_config(cfg).num_params() == sum(p.numel() for p in model.parameters())


def test_sharding_offload_and_lora_shrink_the_model_states():
    cfg = build_config(overrides=GRPO_7B)
    plan = build_plan(cfg, 8)
    shape = ModelShape.from_path(QWEN_7B)
    plain = estimate_memory(cfg, plan, shape, Cluster(1, 8, 80)).phase("actor_update")
    sharded = estimate_memory(cfg, plan, shape, Cluster(1, 8, 80), WhatIf(fsdp_size=8)).phase("actor_update")
    lora = estimate_memory(cfg, plan, shape, Cluster(1, 8, 80), WhatIf(lora_rank=32)).phase("actor_update")
    assert plain.part("actor optimizer") == 2 * plain.part("actor weights")  # bf16 AdamW moments, no master copy
    assert sharded.part("actor optimizer") == plain.part("actor optimizer") // 8
    # r=32 adapters are ~1% of 7.6B parameters; their AdamW moments are fp32 (PEFT keeps adapters fp32 on a bf16
    # base), the full model's bf16: ~2% of the bytes.
    assert lora.part("actor optimizer") < plain.part("actor optimizer") / 40
    assert sharded.total < plain.total and lora.total < plain.total


def test_lora_in_the_config_drops_the_reference_copy_and_full_optimizer():
    """model.lora_rank: adapter-only gradients and fp32 AdamW states, no reference weights (the actor with its
    adapters disabled is the reference); the critic still trains every weight."""
    shape = ModelShape.from_path(QWEN_7B)
    base = [*GRPO_7B, "actor.use_kl_loss=true", "algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4"]
    full = build_config(overrides=base)
    lora = build_config(overrides=[*base, "model.lora_rank=64", "model.target_modules=[q_proj,v_proj]"])
    est_full = estimate_memory(full, build_plan(full, 8), shape, Cluster(1, 8, 80)).phase("actor_update")
    est_lora = estimate_memory(lora, build_plan(lora, 8), shape, Cluster(1, 8, 80)).phase("actor_update")
    adapters = 64 * shape.num_layers * ((shape.hidden_size + shape.q_dim) + (shape.hidden_size + shape.kv_dim))
    assert shape.lora_params(64, ("q_proj", "v_proj")) == adapters
    assert est_full.part("reference weights") == est_full.part("actor weights") > 0
    assert est_lora.part("reference weights") == 0
    assert est_lora.part("actor weights") == est_full.part("actor weights") + 4 * adapters
    assert est_lora.part("actor optimizer") == 2 * 4 * adapters
    assert est_lora.part("critic optimizer") == est_full.part("critic optimizer") > 0
    assert est_lora.detail["gradients_gib"] == round(4 * adapters / GIB, 3)


def test_chunking_and_checkpointing_lower_the_update_estimate():
    shape = ModelShape.from_path(QWEN_7B)
    base = [*GRPO_7B[:5], "model.dtype=bf16", "actor.ppo_micro_batch_size_per_gpu=4"]
    totals = {}
    for name, extra in {"plain": [], "gc": ["model.enable_gradient_checkpointing=true"],
                        "chunk": ["actor.entropy_from_logits_with_chunking=true", "actor.entropy_checkpointing=true"]}.items():  # fmt: skip
        cfg = build_config(overrides=base + extra)
        est = estimate_memory(cfg, build_plan(cfg, 8), shape, Cluster(1, 8, 80), WhatIf(fsdp_size=8))
        totals[name] = est.phase("actor_update")
    assert totals["gc"].part("gradients/activations") < totals["plain"].part("gradients/activations") / 5
    assert totals["chunk"].part("log-prob/entropy head") < totals["plain"].part("log-prob/entropy head") / 3


def test_advice_follows_the_seeds_order_and_fits():
    """An activation-bound 7B update on 80 GB: checkpointing first, then the chunked head, then smaller micro."""
    overrides = [*GRPO_7B[:5], "model.dtype=bf16", "actor.ppo_micro_batch_size_per_gpu=8"]
    cfg = build_config(overrides=overrides)
    shape, cluster, what_if = ModelShape.from_path(QWEN_7B), Cluster(1, 8, 80), WhatIf(fsdp_size=8)
    est = estimate_memory(cfg, build_plan(cfg, 8), shape, cluster, what_if)
    advice = advise(cfg, est, shape, cluster, what_if)
    a = advice["actor_update"]
    assert a.fits and a.peak_bytes <= 80 * GIB
    keys = list(a.overrides)
    assert keys[0] == "model.enable_gradient_checkpointing"


def test_explain_prints_per_gpu_estimates_for_seed_002_72b_and_a_7b_grpo_run(capsys):
    assert main(["explain", *SEED_002, "--model-config", QWEN_72B, "--nodes", "1", "--gpus-per-node", "8",
                 "--gpu-memory-gb", "80", *SEED_002_WHAT_IF]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "Estimated peak memory per GPU" in text and "72.7B params" in text and "actor_update" in text
    assert "vLLM reservation" in text and "OOM" not in text
    # Without the what-if sharding/offload/LoRA, the 72B states alone are far over 80 GB: a warning says so.
    assert main(["explain", *SEED_002, "--model-config", QWEN_72B, "--gpus-per-node", "8", "--gpu-memory-gb", "80"]) == 0
    text = capsys.readouterr().out
    assert "NO (OOM)" in text and "model states alone exceed the GPU" in text
    assert main(["explain", *GRPO_7B, "--model-config", QWEN_7B, "--gpus-per-node", "8", "--gpu-memory-gb", "80",
                 "--fsdp-size", "-1", "--suggest"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "7.6B params" in text and "starting point for a medium" in text


def test_explain_json_adds_memory_estimate_and_keeps_the_plan_keys(capsys):
    assert main(["explain", *GRPO_7B, "--model-config", QWEN_7B, "--gpus-per-node", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("world_size", "prompts_per_step", "samples_per_step", "actor", "old_log_prob", "max_policy_lag"):
        assert key in out
    assert out["world_size"] == 8
    mem = out["memory_estimate"]
    assert mem["peak_phase"] in mem["phases"] and mem["model"]["num_params"] > 7e9
    assert main(["explain", "model.path=/nonexistent/model", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_estimate"] is None


def test_explain_rejects_bad_cluster_options(capsys):
    assert main(["explain", "--gpus-per-node", "0"]) == 2
    assert main(["explain", *GRPO_7B, "--gpus-per-node", "8", "--fsdp-size", "3", "--model-config", QWEN_7B]) == 2
    assert "--fsdp-size" in capsys.readouterr().err


@pytest.mark.parametrize("path", [QWEN_72B, QWEN_7B])
def test_starting_points_make_valid_plans(path):
    point = starting_point(ModelShape.from_path(path))
    assert check_starting_point(point, 8, lambda: build_config()) is None
