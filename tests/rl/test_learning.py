"""The main job learns: the built-in model's validation accuracy rises clearly under GRPO and PPO.

These run the real default (`posttrain train` with no arguments) with fewer steps. The first one
also builds and caches the warm-started built-in model, so this file takes a few minutes.
"""

import os

import pytest
import torch

from posttrain.config.load import build_config
from posttrain.rl.train_command import run_training
from posttrain.utils.metrics import read_metrics


@pytest.fixture
def two_threads():
    """Both cores for the run, unless pytest-xdist runs another test beside it on the other one: two processes of
    two threads each on two busy cores spin-wait (README: OMP_NUM_THREADS=1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
    yield
    torch.set_num_threads(before)


def learn(tmp_path, *overrides):
    cfg = build_config(
        overrides=[f"trainer.run_dir={tmp_path}", "trainer.loggers=jsonl", "trainer.test_freq=10", *overrides]
    )
    final = run_training(cfg, quiet=True)
    initial = read_metrics(tmp_path / "metrics.jsonl")[0]
    return initial["val/accuracy"], final["val/accuracy"]


@pytest.mark.slow
def test_grpo_default_learns(tmp_path, two_threads):
    before, after = learn(tmp_path, "trainer.total_steps=20")
    assert after >= before + 0.2, (before, after)


@pytest.mark.slow
def test_ppo_with_critic_learns(tmp_path, two_threads):
    before, after = learn(tmp_path, "trainer.total_steps=20", "algorithm.adv_estimator=gae")
    assert after >= before + 0.15, (before, after)


@pytest.mark.slow
def test_grpo_with_lora_learns(tmp_path, two_threads):
    """LoRA rank 32 with the ~10x learning rate the seeds advise (docs/lora.md has the 40-step run)."""
    overrides = ["trainer.total_steps=10", "model.lora_rank=32", "model.lora_alpha=32", "actor.optim.lr=2e-3"]
    before, after = learn(tmp_path, *overrides)
    assert after >= before + 0.2, (before, after)
