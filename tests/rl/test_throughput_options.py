"""The throughput switches end to end: all on matches all off, and misuse fails at setup with a clear error."""

import warnings

import pytest
import torch
from transformers import Gemma2Config, GPT2Config

from posttrain.forward import options as throughput
from posttrain.forward.offload import OffloadActivations
from posttrain.forward.options import pass_options
from posttrain.forward.passes import activation_offload_context
from posttrain.forward.prefix_grouper import check_prefix_grouper
from posttrain.rl import build as setup
from posttrain.rl.checks import check_rl_switches
from posttrain.rl.train_command import run_training
from posttrain.sft.command import run_sft_command
from posttrain.sft.loop import run_sft
from posttrain.utils import console
from tests.helpers import read_metrics, sft_config, small_config

CPU = torch.device("cpu")


def all_on(cfg) -> list[str]:
    """Every switch that works on CPU, with the smallest token budgets the plan accepts (many micro-batches)."""
    budget = cfg.data.max_prompt_length + cfg.data.max_response_length
    return [
        "model.use_remove_padding=true",
        "model.remove_padding_max_row_tokens=64",
        "critic.use_remove_padding=true",
        "model.enable_gradient_checkpointing=true",
        "critic.enable_gradient_checkpointing=true",
        "actor.entropy_from_logits_with_chunking=true",
        "actor.entropy_from_logits_chunk_size=8",
        "actor.entropy_checkpointing=true",
        "ref.entropy_from_logits_with_chunking=true",
        "ref.entropy_from_logits_chunk_size=5",
        "actor.use_dynamic_bsz=true",
        "critic.use_dynamic_bsz=true",
        f"actor.ppo_max_token_len_per_gpu={budget}",
        f"actor.log_prob_max_token_len_per_gpu={budget}",
        f"ref.log_prob_max_token_len_per_gpu={budget}",
        f"critic.ppo_max_token_len_per_gpu={budget}",
        f"critic.forward_max_token_len_per_gpu={budget}",
    ]


ALGORITHMS = {
    "grpo_kl_entropy": ["actor.use_kl_loss=true", "actor.entropy_coeff=0.01"],
    "ppo_gae": ["algorithm.adv_estimator=gae", "algorithm.lam=0.95"],
}
COMPARED = {
    "grpo_kl_entropy": (
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/entropy",
        "actor/kl_loss",
        "actor/pg_clipfrac",
    ),
    "ppo_gae": ("actor/pg_loss", "actor/grad_norm", "critic/loss", "critic/grad_norm", "critic/vpred_mean"),
}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_all_switches_on_match_all_off(tiny_model_dir, tmp_path, algorithm):
    extra = [*ALGORITHMS[algorithm], "trainer.total_steps=1", "trainer.export_hf=false"]
    off_cfg = small_config(tiny_model_dir, tmp_path / "off", *extra)
    on_cfg = small_config(tiny_model_dir, tmp_path / "on", *extra, *all_on(off_cfg))
    run_training(off_cfg, quiet=True)
    run_training(on_cfg, quiet=True)
    off, on = read_metrics(tmp_path / "off")[0], read_metrics(tmp_path / "on")[0]
    assert on["actor/micro_batches"] > off["actor/micro_batches"]  # the token budget really split differently
    assert on["reward/mean"] == off["reward/mean"]  # same rollout
    for key in COMPARED[algorithm]:
        assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-6), key
    assert off["actor/grad_norm"] > 0


def test_sft_with_switches_matches_plain(tiny_model_dir, tmp_path):
    from posttrain.data.datasets import load_records
    from posttrain.models.hf import load_causal_lm, load_tokenizer

    histories = []
    for name, extra in (
        ("off", []),
        ("on", ["model.use_remove_padding=true", "model.enable_gradient_checkpointing=true"]),
    ):
        (tmp_path / name).mkdir()
        cfg = sft_config(tiny_model_dir, tmp_path / name, "sft.max_steps=2", *extra)
        records = load_records(cfg.sft.train_files[0], "prompt", "response")
        model = load_causal_lm(tiny_model_dir)
        histories.append(run_sft(cfg, model, load_tokenizer(tiny_model_dir), records, quiet=True))
    for a, b in zip(*histories):
        for key in ("sft/loss", "sft/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), key


def test_prefix_grouper_and_bypass_mode_match_plain(tiny_model_dir, tmp_path):
    """Two GRPO steps with a KL loss: the shared-prompt forward and the rollout's own log-probs as old log-probs
    give the losses, gradients and (second-step) rollouts of the plain run."""
    extra = ["actor.use_kl_loss=true", "actor.entropy_coeff=0.01", "trainer.export_hf=false"]
    runs = {
        "plain": [],
        "grouped": ["actor.use_prefix_grouper=true", "model.remove_padding_max_row_tokens=48"],
        "bypass": ["algorithm.rollout_correction.bypass_mode=true"],
        "grouped-budget": [
            "actor.use_prefix_grouper=true",
            "actor.use_dynamic_bsz=true",
            "actor.ppo_max_token_len_per_gpu=120",
            "actor.log_prob_max_token_len_per_gpu=120",
        ],
    }
    metrics = {}
    for name, switches in runs.items():
        run_training(small_config(tiny_model_dir, tmp_path / name, *extra, *switches), quiet=True)
        metrics[name] = read_metrics(tmp_path / name)
    for name in ("grouped", "bypass", "grouped-budget"):
        for step, (plain, other) in enumerate(zip(metrics["plain"], metrics[name], strict=True)):
            assert other["reward/mean"] == plain["reward/mean"], (name, step)
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/ppo_kl"):
                assert other[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), (name, step, key)
    assert "timing/old_log_prob" in metrics["plain"][0] and "timing/old_log_prob" not in metrics["bypass"][0]


def test_bypass_mode_places_the_engine_log_probs_and_names_missing_ones():
    from posttrain.data.batch import build_rollout_batch
    from posttrain.rl.collect.generation import rollout_log_probs
    from posttrain.rollout.base import RolloutResult

    result = RolloutResult([0, 0], [[5, 6, 7], [8]], [[-0.5, -1.0, -1.5], [-2.0]], ["length", "eos"])
    batch = build_rollout_batch([[1, 2], [1, 2]], result.response_ids, result.prompt_index, pad_token_id=0)
    expected = torch.tensor([[-0.5, -1.0, -1.5], [-2.0, 0.0, 0.0]])
    torch.testing.assert_close(rollout_log_probs(result, batch), expected)
    result.response_logprobs[1] = []
    with pytest.raises(ValueError, match=r"bypass_mode=true needs .* sample 1 has 1 tokens and 0 log-probs"):
        rollout_log_probs(result, batch)


def test_prefix_grouper_refuses_sequence_parallel(tiny_model_dir, tmp_path):
    cfg = small_config(tiny_model_dir, tmp_path / "run", "actor.use_prefix_grouper=true")
    cfg.actor.ulysses_sequence_parallel_size = 2
    with pytest.raises(
        ValueError, match=r"actor\.use_prefix_grouper=true cannot be combined with actor\.ulysses"
    ):
        check_prefix_grouper(cfg)


def test_prefix_grouper_loads_the_shared_prefix_attention_even_where_packing_picks_flash(monkeypatch):
    monkeypatch.setattr(throughput, "preferred_attn_implementation", lambda device: "flash_attention_2")
    assert throughput.attn_implementation(True, CPU) == "flash_attention_2"
    assert throughput.attn_implementation(True, CPU, prefix_grouper=True) == "posttrain_shared_prefix"


@pytest.fixture
def no_weight_loading(monkeypatch):
    """Setup must fail on a config error before loading any weights."""

    def fail(*args, **kwargs):
        raise AssertionError("weights were loaded before the config error was raised")

    monkeypatch.setattr(setup, "load_causal_lm", fail)
    monkeypatch.setattr(setup, "resolve_model_path", fail)


def model_dir(tmp_path, config) -> str:
    path = tmp_path / config.model_type
    config.save_pretrained(path)  # a config.json is all the setup checks read
    return str(path)


def test_packing_unverified_architecture_is_named(tmp_path, no_weight_loading):
    path = model_dir(tmp_path, GPT2Config(n_layer=1, n_embd=32, n_head=2))
    cfg = small_config(path, tmp_path / "run", "model.use_remove_padding=true")
    with pytest.raises(
        ValueError, match=r"model\.use_remove_padding=true.*'gpt2'.*test_packing_equivalence\.py"
    ):
        run_training(cfg, quiet=True)
    cfg = small_config(
        path,
        tmp_path / "run",
        "algorithm.adv_estimator=gae",
        "critic.use_remove_padding=true",
        f"critic.model_path={path}",
    )
    with pytest.raises(ValueError, match=r"critic\.use_remove_padding=true.*register_packing_support"):
        run_training(cfg, quiet=True)


@pytest.mark.parametrize("key", ["actor", "ref"])
def test_chunking_refuses_soft_capped_head(tmp_path, no_weight_loading, key):
    path = model_dir(tmp_path, Gemma2Config(num_hidden_layers=1, hidden_size=32, intermediate_size=64))
    cfg = small_config(
        path, tmp_path / "run", "actor.use_kl_loss=true", f"{key}.entropy_from_logits_with_chunking=true"
    )
    with pytest.raises(
        ValueError, match=rf"{key}\.entropy_from_logits_with_chunking=true.*gemma2.*final_logit_softcapping"
    ):
        run_training(cfg, quiet=True)


def test_entropy_checkpointing_needs_chunking(tiny_model_dir, tmp_path, no_weight_loading):
    cfg = small_config(tiny_model_dir, tmp_path / "run", "actor.entropy_checkpointing=true")
    with pytest.raises(
        ValueError, match=r"actor\.entropy_checkpointing=true.*actor\.entropy_from_logits_with_chunking"
    ):
        run_training(cfg, quiet=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_liger_on_cpu_is_a_clear_error(tiny_model_dir, tmp_path, no_weight_loading):
    cfg = small_config(tiny_model_dir, tmp_path / "run", "model.use_liger=true")
    with pytest.raises(ValueError, match=r"model\.use_liger=true needs a CUDA device"):
        run_training(cfg, quiet=True)
    with pytest.raises(ValueError, match=r"model\.use_liger=true"):
        run_sft_command(sft_config(tiny_model_dir, tmp_path, "model.use_liger=true"))


def test_activation_offload_warns_on_cpu_and_is_cuda_only(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(console, "_WARNED", set())
    cfg = small_config(
        tiny_model_dir,
        tmp_path / "run",
        "model.enable_activation_offload=true",
        "critic.enable_activation_offload=true",
        "algorithm.adv_estimator=gae",
    )
    with pytest.warns(RuntimeWarning) as record:
        check_rl_switches(cfg, CPU, uses_ref=False, uses_critic=True)
    messages = [str(w.message) for w in record]
    for key in ("model.enable_activation_offload", "critic.enable_activation_offload"):
        assert sum(m.startswith(f"{key}=true has no effect on cpu") for m in messages) == 1, messages
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: a second check stays quiet
        check_rl_switches(cfg, CPU, uses_ref=False, uses_critic=True)
    assert not pass_options(cfg, CPU).actor.offload_activations
    cuda = pass_options(cfg, torch.device("cuda"))  # a device object needs no GPU
    assert cuda.actor.offload_activations and cuda.critic.offload_activations and cuda.sft.offload_activations
    assert not cuda.old_log_prob.offload_activations and not cuda.ref.offload_activations  # forward-only
    # The CUDA path is save_on_cpu's pinned offload, contiguous tensors only; everywhere else a no-op context.
    assert isinstance(activation_offload_context(True, "cuda"), OffloadActivations)
    for enabled, device in ((True, "cpu"), (False, "cuda"), (False, "cpu")):
        assert not isinstance(activation_offload_context(enabled, device), OffloadActivations)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_activation_offload_on_cuda_gives_identical_grads():
    from posttrain.forward.passes import ForwardOptions
    from posttrain.train.losses import actor_loss_fn

    from .test_throughput_equivalence import ACTOR_CFG, TEMPERATURE, one_step, tiny_policy  # noqa: TID252

    grads = []
    for offload in (False, True):
        model = tiny_policy().cuda()
        options = ForwardOptions(offload_activations=offload)
        grads.append(one_step(model, actor_loss_fn(model, ACTOR_CFG, TEMPERATURE, options), "micro2")[0])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
