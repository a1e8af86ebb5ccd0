"""Rank-local data on two real gloo ranks: what crosses ranks does not grow with the batch, and SP groups of
different sizes (the critic's smaller than the actor's) still train like one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.parallel.conftest import torchrun
from tests.parallel.test_distributed_training import _metrics, _options, _run, _same_training

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]  # a hung job fails the test, its processes killed

# Checkpointing moves the model's state (its size, not the batch's): left out of the step's bytes.
CHECKPOINT_CALLERS = ("posttrain.train.",)


def _step_options(model_dir, run_dir: Path, prompts: int) -> dict:
    """One step of PPO with a critic (GAE, whitened advantages), a reference model (KL loss) and the in-reward KL
    penalty (the adaptive controller), two PPO epochs (so the old log-probs are recomputed), one mini-batch."""
    return _options(
        model_dir,
        run_dir,
        **{
            "data.train_batch_size": prompts,
            "actor.ppo_mini_batch_size": prompts,
            "critic.ppo_mini_batch_size": prompts,
            "actor.ppo_epochs": 2,
            "critic.ppo_micro_batch_size_per_gpu": 2,
            "critic.forward_micro_batch_size_per_gpu": 2,
            "actor.log_prob_micro_batch_size_per_gpu": 2,
            "algorithm.adv_estimator": "gae",
            "actor.use_kl_loss": "true",
            "algorithm.use_kl_in_reward": "true",
            "algorithm.kl_ctrl.type": "adaptive",
            "data.max_response_length": 16,
            "trainer.total_steps": 1,
            "trainer.test_freq": 0,
        },
    )


def _bytes(tmp_path, model_dir, prompts: int) -> list[dict[str, int]]:
    out = tmp_path / f"out{prompts}"
    torchrun(2, "collective_bytes", out, _step_options(model_dir, tmp_path / f"run{prompts}", prompts))
    return [json.loads((out / f"bytes_{rank}.json").read_text()) for rank in (0, 1)]


def test_bytes_crossing_ranks_do_not_grow_with_the_batch(tmp_path, tiny_model_dir):
    """Every torch.distributed call posttrain makes from Python is counted on each rank (bytes it sends:
    pickled objects, tensors; FSDP2's own parameter/gradient collectives are not among them), per calling
    function, over a whole 2-rank run of one step at 4 and at 8 prompts (16 and 32 samples, 4 per prompt).

    Asserted: on each rank the bytes per caller are identical at both batch sizes (so nothing sent depends on
    the number of samples or their lengths: no rollout result, score or forward output crosses ranks), and the
    step's own bytes (checkpointing aside) stay under 1 KiB: a few dozen float64 sums and maxima (counts,
    whitening moments, the batch KL, metrics), against the 5.5 and 8.7 KB rank 0 sent before (pickled rollout
    results and gathered forward outputs, growing with the batch)."""
    small, large = _bytes(tmp_path, tiny_model_dir, 4), _bytes(tmp_path, tiny_model_dir, 8)
    assert small == large
    for counts in small:
        step = {k: v for k, v in counts.items() if not k.startswith(CHECKPOINT_CALLERS)}
        assert not any(k.startswith("posttrain.rl.collect.generation:") for k in step), (
            step
        )  # no rollout gather
        assert "posttrain.train.update:forward_in_micro_batches" not in step, step  # no forward gather
        assert 0 < sum(step.values()) <= 1024, step


def test_critic_in_smaller_sp_groups_than_the_actor_trains_like_one(tmp_path, tiny_model_dir):
    """Actor and reference in one SP group of 2, the critic with SP 1: both ranks hold the one share (their
    rollout parts joined within it), the critic's two DP ranks split each of its mini-batches between them and
    compute the values once each. Same samples and losses as one process."""
    extra = {
        "algorithm.adv_estimator": "gae",
        "critic.ppo_mini_batch_size": 2,
        "critic.ppo_micro_batch_size_per_gpu": 2,
        "critic.forward_micro_batch_size_per_gpu": 4,
        "actor.use_kl_loss": "true",
    }
    sp = {"actor.ulysses_sequence_parallel_size": 2, "ref.ulysses_sequence_parallel_size": 2}
    one, two = tmp_path / "one", tmp_path / "two"
    _run(1, tmp_path / "o1", _options(tiny_model_dir, one, **extra))
    _run(2, tmp_path / "o2", _options(tiny_model_dir, two, **extra, **sp))
    a, b = _metrics(one), _metrics(two)
    _same_training(a, b)
    trained = [(ma, mb) for ma, mb in zip(a, b) if "critic/loss" in ma]
    assert len(trained) == 2
    for ma, mb in trained:
        for key in ("critic/loss", "critic/grad_norm", "critic/vpred_mean"):
            assert mb[key] == pytest.approx(ma[key], rel=1e-4, abs=1e-6), (ma["step"], key)
