"""Non-finite guards: config values, skipped optimizer steps, checkpoints of NaN weights, absurd rewards."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from posttrain.cli import main
from posttrain.config.load import build_config
from posttrain.parallel.runtime import DistContext
from posttrain.rewards.runner import RewardInput, RewardRunner
from posttrain.rl.train_command import run_training
from posttrain.rm.command import run_rm_command
from posttrain.rm.demo import write_arithmetic_pairs
from posttrain.sft.command import run_sft_command
from posttrain.train.guards import NonFiniteError, SkippedStepGuard, check_finite_weights
from tests.helpers import read_metrics, sft_cli_args, small_config


@pytest.mark.parametrize(
    "override, key",
    [
        ("actor.optim.lr=nan", "actor.optim.lr"),
        ("critic.optim.lr=inf", "critic.optim.lr"),
        ("actor.optim.betas=0.9", "actor.optim.betas"),
        ("actor.optim.betas=[0.9,1.0]", "actor.optim.betas"),
        ("sft.optim.betas=[0.9,0.99,0.999]", "sft.optim.betas"),
        ("actor.optim.eps=0", "actor.optim.eps"),
        ("actor.optim.weight_decay=inf", "actor.optim.weight_decay"),
        ("actor.optim.weight_decay=-0.1", "actor.optim.weight_decay"),
        ("reward.failure_reward=nan", "reward.failure_reward"),
        ("reward.failure_reward=-inf", "reward.failure_reward"),
    ],
)
def test_non_finite_or_malformed_optimizer_values_are_config_errors(override, key, capsys):
    assert main(["explain", override]) == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err


def test_skipped_step_guard_warns_and_stops_after_a_streak(caplog):
    guard = SkippedStepGuard(limit=2, roles=("actor", "critic"))
    ok = {"actor/optimizer_steps": 2.0, "actor/skipped_steps": 0.0}
    partial = {"actor/optimizer_steps": 2.0, "actor/skipped_steps": 1.0}
    total = {"actor/optimizer_steps": 2.0, "actor/skipped_steps": 2.0}
    guard.observe(1, total)
    assert "step 1" in caplog.text and "non-finite" in caplog.text
    guard.observe(2, partial)  # one step applied: the streak starts again
    guard.observe(3, ok)
    guard.observe(4, total)
    with pytest.raises(NonFiniteError, match="trainer.max_skipped_steps=2"):
        guard.observe(5, total)


def _train(model_dir, run, *extra):
    run_training(small_config(model_dir, run, "trainer.total_steps=5", *extra), quiet=True)


def _rm(model_dir, run, *extra):
    write_arithmetic_pairs(run.parent, n_train=16, n_val=6, seed=3)
    overrides = [
        f"model.path={model_dir}",
        f"data.train_files=[{run.parent / 'train.jsonl'}]",
        f"data.val_files=[{run.parent / 'val.jsonl'}]",
        f"trainer.run_dir={run}",
        "rm.batch_size=4",
        "rm.micro_batch_size_per_gpu=2",
        "rm.max_steps=4",
        "trainer.test_freq=2",
    ]
    run_rm_command(build_config(overrides=[*overrides, *extra]), quiet=True)


def _sft(model_dir, run, *extra):
    run_sft_command(build_config(overrides=[*sft_cli_args(run, model_dir, rows=20), *extra]), quiet=True)


@pytest.mark.parametrize("limit", [1, 2])
@pytest.mark.parametrize("command", [_train, _rm, _sft], ids=["train", "rm", "sft"])
def test_every_command_stops_after_max_skipped_steps_and_keeps_no_bad_checkpoint(
    tiny_model_dir, tmp_path, monkeypatch, command, limit
):
    """trainer.max_skipped_steps=N: the N-th consecutive step whose optimizer steps were all skipped stops the
    run, in every command (drill: `posttrain rm` stopped at the N+1-th, `posttrain sft` never stopped)."""

    def nan_norm(params, max_norm, *args, **kwargs):
        return torch.tensor(math.nan)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", nan_norm)
    run = tmp_path / "run"
    with pytest.raises(NonFiniteError, match=f"steps 1-{limit}: .*trainer.max_skipped_steps={limit}"):
        command(tiny_model_dir, run, f"trainer.max_skipped_steps={limit}")
    steps = [m for m in read_metrics(run) if m["step"] >= 1]
    assert [m["step"] for m in steps] == list(range(1, limit + 1))  # counted in metrics, per step
    assert all(v for m in steps for k, v in m.items() if k.endswith("/skipped_steps"))
    assert not (run / "checkpoints").exists()


def test_checkpoint_of_non_finite_weights_is_refused():
    model = nn.Linear(3, 3)
    check_finite_weights({"actor": model}, DistContext())
    with torch.no_grad():
        model.weight[1, 2] = math.nan
    with pytest.raises(NonFiniteError, match="actor: weight"):
        check_finite_weights({"actor": model}, DistContext())


def _absurd(prompt, response, ground_truth, extra):
    return {"big": 1e9, "nan": math.nan, "ok": 0.5}[response]


@pytest.mark.parametrize("timeout_s", [0, 5])
def test_non_finite_or_absurd_rewards_are_failures(timeout_s):
    samples = [RewardInput("p", r) for r in ("big", "nan", "ok")]
    with RewardRunner(_absurd, timeout_s=timeout_s, failure_reward=-1.0) as runner:
        rewards, metrics = runner.score(samples)
    assert rewards == [-1.0, -1.0, 0.5]
    assert metrics["reward/num_failures"] == 2.0
