"""The memory estimator's formulas, explain's estimate output and JSON, advice, starting points (no GPU)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from posttrain.cli import main
from posttrain.config.load import build_config
from posttrain.config.plan import build_plan
from posttrain.planning.advice import advise, check_starting_point, starting_point
from posttrain.planning.memory import Cluster, estimate_memory
from posttrain.planning.memory_bytes import WhatIf
from posttrain.planning.shape import GIB, ModelShape

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "model_configs"
QWEN_72B = str(CONFIGS / "qwen2.5-72b")
QWEN_7B = str(CONFIGS / "qwen2.5-7b")
# Seed 002's Qwen2.5-72B reference (verl): 64 prompts x n=5, prompt + response within max_model_len 1536.
SEED_002 = [
    "data.train_batch_size=64",
    "rollout.n=5",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "model.dtype=bf16",
    "actor.ppo_mini_batch_size=16",
    "actor.ppo_micro_batch_size_per_gpu=1",
    "actor.log_prob_micro_batch_size_per_gpu=2",
    "rollout.chunk_size=16",
]
SEED_002_WHAT_IF = [
    "--fsdp-size",
    "8",
    "--lora-rank",
    "32",
    "--param-offload",
    "--optimizer-offload",
    "--rollout-engine",
    "vllm",
    "--gpu-memory-utilization",
    "0.4",
    "--rollout-tp",
    "8",
    "--max-num-seqs",
    "64",
]
# A 7B GRPO run (seed 004's medium model on 8 GPUs: 256 prompts x 8, 64 samples = 8 prompts per update).
GRPO_7B = [
    "data.train_batch_size=256",
    "rollout.n=8",
    "actor.ppo_mini_batch_size=8",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "model.dtype=bf16",
    "actor.ppo_micro_batch_size_per_gpu=1",
    "actor.log_prob_micro_batch_size_per_gpu=2",
    "model.enable_gradient_checkpointing=true",
    "actor.entropy_from_logits_with_chunking=true",
    "actor.entropy_checkpointing=true",
    "rollout.chunk_size=16",
]


@pytest.mark.parametrize("path", [QWEN_72B, QWEN_7B])
def test_parameter_count_is_exact_for_the_real_architectures(path):
    shape = ModelShape.from_path(path)
    with torch.device("meta"):  # no memory: only shapes
        model = Qwen2ForCausalLM(Qwen2Config(**json.loads((Path(path) / "config.json").read_text())))
    assert shape.num_params() == sum(p.numel() for p in model.parameters())


def test_parameter_count_tiny_tied():
    cfg = Qwen2Config(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    assert ModelShape.from_hf_config(cfg).num_params() == sum(p.numel() for p in model.parameters())


def test_one_gpu_keeps_every_model_state_whole_in_model_dtype():
    cfg = build_config(overrides=GRPO_7B)
    shape = ModelShape.from_path(QWEN_7B)
    one = estimate_memory(cfg, build_plan(cfg, 1), shape, Cluster(1, 1, 80)).phase("actor_update")
    assert one.part("actor weights") == shape.num_params() * 2  # bf16, unsharded, nothing gathered
    assert one.part("actor optimizer") == 2 * one.part("actor weights")  # bf16 AdamW moments, no master copy
    assert one.part("rollout weights") == 0  # the engine shares the actor's module
    # param_offload needs FSDP2 (several GPUs): on one GPU the config key changes nothing.
    off = build_config(overrides=[*GRPO_7B, "actor.fsdp_config.param_offload=true"])
    assert (
        estimate_memory(off, build_plan(off, 1), shape, Cluster(1, 1, 80)).phase("actor_update").total
        == one.total
    )


def test_several_gpus_read_the_fsdp_config_as_the_trainer_applies_it():
    """8 GPUs, bf16: FSDP2 over all of them (fsdp_size -1), fp32 master weights for the actor, a bf16 critic,
    an unsharded bf16 rollout copy on every GPU; fsdp_size, param_offload and optimizer_offload act per role."""
    shape = ModelShape.from_path(QWEN_7B)
    n, layer = shape.num_params(), shape.layer_params()
    gathered = 2 * layer * 2  # two bf16 layers gathered at a time

    def update(*extra: str, what_if: WhatIf | None = None, phase: str = "actor_update"):
        cfg = build_config(overrides=[*GRPO_7B, *extra])
        return estimate_memory(cfg, build_plan(cfg, 8), shape, Cluster(1, 8, 80), what_if).phase(phase)

    sharded = update()
    assert sharded.part("actor weights") == n * 4 // 8 + gathered
    assert sharded.part("actor optimizer") == 2 * n * 4 // 8
    assert sharded.part("rollout weights") == n * 2
    assert sharded.detail["gradients_gib"] == round(n * 4 // 8 / GIB, 3)
    hsdp = update("actor.fsdp_config.fsdp_size=4")
    assert hsdp.part("actor optimizer") == 2 * sharded.part("actor optimizer")
    offload = update("actor.fsdp_config.param_offload=true")
    assert offload.part("actor weights") == gathered
    assert offload.part("actor optimizer") == 0 and offload.detail["gradients_gib"] == 0
    opt = update("actor.fsdp_config.optimizer_offload=true")
    assert opt.part("actor optimizer") == 0 and opt.part("actor weights") == sharded.part("actor weights")
    # The moments come back for the step, next to the gradients.
    assert opt.part("gradients/activations") == n * 4 // 8 + 2 * n * 4 // 8
    critic = update(
        "algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4", phase="critic_update"
    )
    critic_n = shape.num_params() - shape.vocab_size * shape.hidden_size * (
        0 if shape.tie_word_embeddings else 1
    )
    assert critic.part("critic optimizer") == 2 * critic_n * 2 // 8  # loaded in model.dtype: no master copy
    # What-ifs override every role's config; None keeps the config.
    replicated = update(what_if=WhatIf(fsdp_size=1, master_weights_fp32=False))
    assert replicated.part("actor optimizer") == 2 * n * 2
    lora = update(what_if=WhatIf(lora_rank=32))
    assert lora.part("actor optimizer") < sharded.part("actor optimizer") / 40


def test_rollout_estimate_is_the_engines_slot_cache():
    """The estimate's KV cache is what the engine allocates at most: max_num_seqs slots of prompt + response
    tokens (a call with fewer samples than that allocates a slot per sample, rounded up to a power of two)."""
    from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.native.engine import NativeEngine

    model = build_tiny_model(build_tiny_tokenizer(), hidden_size=64, num_hidden_layers=2)
    shape = ModelShape.from_hf_config(model.config)
    cfg = build_config(
        overrides=[
            "data.max_prompt_length=12",
            "data.max_response_length=6",
            "rollout.max_num_seqs=16",
            "rollout.max_num_batched_tokens=64",
            "model.dtype=fp32",
        ]
    )
    est = estimate_memory(cfg, build_plan(cfg), shape).phase("rollout")
    engine = NativeEngine(
        model, eos_token_ids=[1], pad_token_id=0, max_num_seqs=16, max_num_batched_tokens=64
    )
    prompts = [list(range(3, 15)), list(range(3, 10))]
    engine.generate(prompts, SamplingParams(n=4, max_tokens=6, seed=0))  # 8 samples: 8 slots
    allocated = sum(t.numel() * t.element_size() for t in [*engine.cache.k, *engine.cache.v])
    assert allocated == est.part("KV cache") // 2
    engine.generate(prompts, SamplingParams(n=8, max_tokens=6, seed=0))  # 16 samples: every slot
    allocated = sum(t.numel() * t.element_size() for t in [*engine.cache.k, *engine.cache.v])
    # Slots hold the longest prompt + max_tokens - 1 positions (the last token is never fed back) + one scratch.
    assert allocated == est.part("KV cache")
    assert est.detail["kv_cache_slots"] == 16


def test_lora_in_the_config_drops_the_reference_copy_and_full_optimizer():
    """model.lora_rank: adapter-only gradients and fp32 AdamW states, no reference weights (the actor with its
    adapters disabled is the reference); the critic still trains every weight."""
    shape = ModelShape.from_path(QWEN_7B)
    base = [
        *GRPO_7B,
        "actor.use_kl_loss=true",
        "algorithm.adv_estimator=gae",
        "critic.ppo_micro_batch_size_per_gpu=4",
    ]
    full = build_config(overrides=base)
    lora = build_config(overrides=[*base, "model.lora_rank=64", "model.target_modules=[q_proj,v_proj]"])
    est_full = estimate_memory(full, build_plan(full, 8), shape, Cluster(1, 8, 80)).phase("actor_update")
    est_lora = estimate_memory(lora, build_plan(lora, 8), shape, Cluster(1, 8, 80)).phase("actor_update")
    adapters = (
        64 * shape.num_layers * ((shape.hidden_size + shape.q_dim) + (shape.hidden_size + shape.kv_dim))
    )
    assert shape.lora_params(64, ("q_proj", "v_proj")) == adapters
    assert est_full.part("reference weights") == est_full.part("actor weights") > 0
    assert est_lora.part("reference weights") == 0
    assert (
        est_lora.part("actor weights") == est_full.part("actor weights") + 4 * adapters // 8
    )  # sharded over 8
    assert est_lora.part("actor optimizer") == 2 * 4 * adapters // 8
    assert est_lora.part("critic optimizer") == est_full.part("critic optimizer") > 0
    assert est_lora.detail["gradients_gib"] == round(4 * adapters // 8 / GIB, 3)


def test_chunking_and_checkpointing_lower_the_update_estimate():
    shape = ModelShape.from_path(QWEN_7B)
    base = [*GRPO_7B[:5], "model.dtype=bf16", "actor.ppo_micro_batch_size_per_gpu=4"]
    totals = {}
    for name, extra in {
        "plain": [],
        "gc": ["model.enable_gradient_checkpointing=true"],
        "chunk": ["actor.entropy_from_logits_with_chunking=true", "actor.entropy_checkpointing=true"],
    }.items():
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
    assert (
        main(
            [
                "explain",
                *SEED_002,
                "--model-config",
                QWEN_72B,
                "--nodes",
                "1",
                "--gpus-per-node",
                "8",
                "--gpu-memory-gb",
                "80",
                *SEED_002_WHAT_IF,
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "Estimated peak memory per GPU" in text and "72.7B params" in text and "actor_update" in text
    assert "vLLM reservation" in text and "OOM" not in text
    # Without the what-if sharding/offload/LoRA, the 72B states alone are far over 80 GB: a warning says so.
    assert (
        main(
            [
                "explain",
                *SEED_002,
                "--model-config",
                QWEN_72B,
                "--gpus-per-node",
                "8",
                "--gpu-memory-gb",
                "80",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "NO (OOM)" in text and "model states alone exceed the GPU" in text
    assert "unsharded rollout copy of the policy" in text  # 135 GiB of bf16 weights on every GPU
    assert (
        main(
            [
                "explain",
                *GRPO_7B,
                "--model-config",
                QWEN_7B,
                "--gpus-per-node",
                "8",
                "--gpu-memory-gb",
                "80",
                "--fsdp-size",
                "-1",
                "--suggest",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "7.6B params" in text and "starting point for a medium" in text
    assert "actor weights: sharded over 8 GPUs; fp32 master weights" in text  # where the states sit


def test_explain_json_adds_memory_estimate_and_keeps_the_plan_keys(capsys):
    assert main(["explain", *GRPO_7B, "--model-config", QWEN_7B, "--gpus-per-node", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "world_size",
        "prompts_per_step",
        "samples_per_step",
        "actor",
        "old_log_prob",
        "max_policy_lag",
    ):
        assert key in out
    assert out["world_size"] == 8
    mem = out["memory_estimate"]
    assert mem["peak_phase"] in mem["phases"] and mem["model"]["num_params"] > 7e9
    assert main(["explain", "model.path=/nonexistent/model", "--json"]) == 2  # as train: no such model


def test_explain_rejects_bad_cluster_options(capsys):
    assert main(["explain", "--gpus-per-node", "0"]) == 2
    assert (
        main(["explain", *GRPO_7B, "--gpus-per-node", "8", "--fsdp-size", "3", "--model-config", QWEN_7B])
        == 2
    )
    assert "--fsdp-size" in capsys.readouterr().err


@pytest.mark.parametrize("path", [QWEN_72B, QWEN_7B])
def test_starting_points_make_valid_plans(path):
    point = starting_point(ModelShape.from_path(path))
    assert check_starting_point(point, 8, lambda: build_config()) is None


@pytest.mark.parametrize("micro", [4, 8, 16])
def test_prefix_grouper_estimate_counts_what_the_grouper_computes(micro):
    """With actor.use_prefix_grouper, a micro-batch's tokens are those the grouper's row holds (each prompt
    once), and its attention mask is within the estimate's bound; the critic's passes are unchanged."""
    from posttrain.data.batch import build_rollout_batch
    from posttrain.forward.prefix_grouper import group_by_prompt

    P, R, n = 6, 4, 8
    base = [
        f"data.max_prompt_length={P}",
        f"data.max_response_length={R}",
        f"rollout.n={n}",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_epochs=2",  # two optimizer steps per rollout: the old-log-prob pass runs
        "critic.ppo_mini_batch_size=4",
        f"actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor.log_prob_micro_batch_size_per_gpu={micro}",
        "algorithm.adv_estimator=gae",
        f"critic.ppo_micro_batch_size_per_gpu={micro}",
        f"critic.forward_micro_batch_size_per_gpu={micro}",
    ]
    shape = ModelShape.from_path(QWEN_7B)
    est = {}
    for on in (False, True):
        cfg = build_config(overrides=[*base, f"actor.use_prefix_grouper={str(on).lower()}"])
        est[on] = estimate_memory(cfg, build_plan(cfg), shape)
    # The micro-batch the trainer would form: `micro` consecutive max-length samples, n per prompt.
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (P,), generator=g).tolist() for _ in range(16 // n)]
    rows = [prompts[i // n] for i in range(micro)]
    responses = [torch.randint(3, 90, (R,), generator=g).tolist() for _ in range(micro)]
    groups = group_by_prompt(
        build_rollout_batch(rows, responses, [i // n for i in range(micro)], pad_token_id=0)
    )
    computed = groups.input_ids.numel()  # every token of the flat row goes through the model
    mask = groups.attention.response_mask
    for phase in ("actor_update", "old_log_prob"):
        assert est[True].phase(phase).detail["micro_batch_tokens"] == computed
        assert est[False].phase(phase).detail["micro_batch_tokens"] == micro * (P + R)
        assert mask.numel() <= est[True].phase(phase).part("prefix-grouper mask")
    for phase in ("critic_update", "values"):
        assert est[True].phase(phase).total == est[False].phase(phase).total
    assert (
        est[True].phase("actor_update").detail["activations_gib"]
        < est[False].phase("actor_update").detail["activations_gib"]
    )


def test_advice_offloads_parameters_then_shrinks_the_rollout_cache():
    """A 7B run on 8 GPUs whose rollout (256 KV-cache slots) does not fit: the config's parameter offload key is
    suggested first (it lowers the estimate on several GPUs), then the largest rollout.max_num_seqs that fits."""
    cfg = build_config(overrides=GRPO_7B)
    shape = ModelShape.from_path(QWEN_7B)

    def advice_for(gib):
        cluster = Cluster(1, 8, gib)
        return advise(cfg, estimate_memory(cfg, build_plan(cfg, 8), shape, cluster), shape, cluster)[
            "rollout"
        ]

    roomy = advice_for(40)
    assert roomy.fits and roomy.overrides == {"actor.fsdp_config.param_offload": True}
    tight = advice_for(30)
    assert tight.fits and tight.overrides["actor.fsdp_config.param_offload"] is True
    slots = tight.overrides["rollout.max_num_seqs"]
    assert 1 <= slots < 256
    bigger = build_config(
        overrides=[*GRPO_7B, "actor.fsdp_config.param_offload=true", f"rollout.max_num_seqs={slots + 1}"]
    )
    over = estimate_memory(bigger, build_plan(bigger, 8), shape, Cluster(1, 8, 30)).phase("rollout").total
    assert over > 30 * GIB  # the largest that fits


def test_a_ray_placed_rollout_worker_costs_the_trainer_nothing():
    """Rollouts ahead on a thread keep the engine's memory resident through every phase; a Ray-placed worker
    takes it to devices of its own: the trainer's phases are what they are without rollouts ahead."""
    shape = ModelShape.from_path(QWEN_7B)

    def estimate(*extra):
        cfg = build_config(overrides=[*GRPO_7B, *extra])
        return estimate_memory(cfg, build_plan(cfg, 1), shape, Cluster(1, 1, 80))

    sync, thread = estimate(), estimate("async_training.enable=true")
    ray = estimate("async_training.enable=true", "async_training.rollout_worker=ray")
    assert thread.phase("actor_update").total > sync.phase("actor_update").total
    assert any("(rollout ahead)" in c.name for c in thread.phase("actor_update").components)
    assert ray.phase("actor_update").total == sync.phase("actor_update").total
    worker = ray.phase("rollout")
    assert worker.part("rollout weights") == shape.num_params() * 2  # its own bf16 copy
    assert worker.part("actor optimizer") == 0  # nothing of the trainer's on the worker's device
