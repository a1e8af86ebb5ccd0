"""FSDP2 data parallelism gives the single-process result: DP=2 vs DP=1, HSDP vs full sharding, knobs on/off.

Each case runs one role update (several optimizer steps, gradient accumulation, packing and dynamic batch
size on) on a fixed batch, on 2 ranks with torchrun and in this process, and compares the updated weights.
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel.conftest import torchrun
from tests.parallel.update_case import run_update_case

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]  # a hung job fails the test, its processes killed

ACTOR = {
    "data.train_batch_size": 4,
    "rollout.n": 4,
    "actor.ppo_mini_batch_size": 2,
    "actor.ppo_epochs": 2,
    "actor.use_dynamic_bsz": "true",
    "actor.ppo_max_token_len_per_gpu": 20,
    "data.max_prompt_length": 8,
    "data.max_response_length": 6,
    "model.use_remove_padding": "true",
    "actor.use_kl_loss": "true",
    "actor.entropy_coeff": 0.01,
    "actor.loss_agg_mode": "seq-mean-token-mean",
    "actor.optim.lr": 1e-2,
    "actor.optim.grad_clip": 0.5,
}
CRITIC = {
    "data.train_batch_size": 4,
    "rollout.n": 4,
    "algorithm.adv_estimator": "gae",
    "actor.ppo_mini_batch_size": 2,
    "actor.ppo_micro_batch_size_per_gpu": 4,
    "critic.ppo_mini_batch_size": 2,
    "critic.ppo_micro_batch_size_per_gpu": 2,
    "critic.use_remove_padding": "true",
    "critic.optim.lr": 1e-2,
}


def _single(tmp_path, model_dir, role: str, options: dict) -> dict:
    out = tmp_path / "single"
    out.mkdir()
    run_update_case(out, {"model": str(model_dir), "role": role, **{k: str(v) for k, v in options.items()}})
    return torch.load(out / "result.pt")


def _ranks(tmp_path, name: str, model_dir, role: str, options: dict) -> dict:
    out = tmp_path / name
    torchrun(2, "update", out, {"model": model_dir, "role": role, **options})
    return torch.load(out / "result.pt")


def _assert_same(a: dict, b: dict, prefix: str) -> None:
    """Same loss and gradient norm to fp32 precision, and the same weight update per tensor to 1e-3 of its
    size. (Elementwise weights are not the right yardstick after Adam steps: Adam divides by each gradient's
    own scale, so a gradient that is ~0 in exact arithmetic, e.g. of attention key biases, moves its weight by
    up to lr whatever tiny rounding it carries; such elements are a handful in 10^5.)"""
    assert a["weights"].keys() == b["weights"].keys()
    for name, value in a["weights"].items():
        torch.testing.assert_close(b["initial"][name], a["initial"][name], rtol=0, atol=0, msg=name)
        update_a, update_b = value - a["initial"][name], b["weights"][name] - a["initial"][name]
        scale = max(float(update_a.norm()), 1e-6)
        assert float((update_b - update_a).norm()) <= 1e-3 * scale, f"{name}: updates differ"
    for key in (f"{prefix}/loss", f"{prefix}/grad_norm"):
        torch.testing.assert_close(b["metrics"][key], a["metrics"][key], rtol=1e-5, atol=1e-7, msg=key)


def test_actor_update_dp2_equals_dp1(tmp_path, tiny_model_dir):
    single = _single(tmp_path, tiny_model_dir, "actor", ACTOR)
    assert single["metrics"]["actor/optimizer_steps"] == 4.0
    _assert_same(single, _ranks(tmp_path, "dp2", tiny_model_dir, "actor", ACTOR), "actor")


def test_critic_update_dp2_equals_dp1(tmp_path, tiny_model_dir):
    single = _single(tmp_path, tiny_model_dir, "critic", CRITIC)
    _assert_same(single, _ranks(tmp_path, "dp2", tiny_model_dir, "critic", CRITIC), "critic")


def test_hsdp_prefetch_and_offload_switches_give_the_same_update(tmp_path, tiny_model_dir):
    """HSDP (shard within groups of 1, replicate across 2), explicit prefetching, no resharding after forward
    and the offload switches change where things live and when they move, never the numbers."""
    single = _single(tmp_path, tiny_model_dir, "actor", ACTOR)
    variant = {
        **ACTOR,
        "actor.fsdp_config.fsdp_size": 1,
        "actor.fsdp_config.forward_prefetch": "true",
        "actor.fsdp_config.reshard_after_forward": "false",
        "actor.fsdp_config.param_offload": "true",
        "actor.fsdp_config.optimizer_offload": "true",
    }
    _assert_same(single, _ranks(tmp_path, "hsdp", tiny_model_dir, "actor", variant), "actor")


def test_prefix_grouper_on_two_ranks_gives_the_plain_update(tmp_path, tiny_model_dir):
    """actor.use_prefix_grouper with DP=2 (each rank gets whole prompt groups; fixed micro-batches, and token
    budgets that pack whole groups) equals the plain padded update in one process."""
    plain = {**ACTOR, "model.use_remove_padding": "false"}
    single = _single(tmp_path, tiny_model_dir, "actor", plain)
    fixed = {
        **ACTOR,
        "actor.use_prefix_grouper": "true",
        "actor.use_dynamic_bsz": "false",
        "actor.ppo_micro_batch_size_per_gpu": 4,
    }
    _assert_same(single, _ranks(tmp_path, "fixed", tiny_model_dir, "actor", fixed), "actor")
    budget = {**ACTOR, "actor.use_prefix_grouper": "true", "actor.ppo_max_token_len_per_gpu": 40}
    _assert_same(single, _ranks(tmp_path, "budget", tiny_model_dir, "actor", budget), "actor")
