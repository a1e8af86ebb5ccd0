"""`posttrain train` under torchrun: DP=2 runs the same training as one process, checkpoints move between
world sizes, and a dead or hung rank ends the job with a clear error instead of a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.parallel.conftest import REPO, WORKERS, end_group, free_port, loopback_env, start_group, torchrun

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]  # a hung job fails the test, its processes killed


def _options(model_dir, run_dir: Path, **extra) -> dict:
    base = {
        "model.path": str(model_dir),
        "data.train_batch_size": 4,
        "rollout.n": 4,
        "actor.ppo_mini_batch_size": 2,
        "actor.ppo_micro_batch_size_per_gpu": 2,
        "actor.log_prob_micro_batch_size_per_gpu": 4,
        "data.num_train_examples": 16,
        "data.num_val_examples": 8,
        "data.max_response_length": 6,
        "trainer.total_steps": 2,
        "trainer.test_freq": 2,
        "trainer.run_dir": str(run_dir),
        "trainer.loggers": "[jsonl]",
        "trainer.export_hf": "false",
        "actor.optim.lr": 1e-3,
    }
    base.update(extra)
    return base


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run(nproc: int, out: Path, options: dict, timeout: float = 300):
    return torchrun(nproc, "train", out, options, timeout=timeout)


def _same_training(a: list[dict], b: list[dict]) -> None:
    """Same rewards (hence the same samples) and the same losses at every step, to fp32 precision."""
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for ma, mb in zip(a, b):
        for key in ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/loss", "val/accuracy"):
            if key in ma:
                assert mb[key] == pytest.approx(ma[key], rel=1e-4, abs=1e-6), (ma["step"], key)


PACKED_DYNAMIC = {
    "model.use_remove_padding": "true",
    "actor.use_dynamic_bsz": "true",
    "actor.ppo_max_token_len_per_gpu": 80,
    "actor.log_prob_max_token_len_per_gpu": 80,
}
CRITIC = {
    "algorithm.adv_estimator": "gae",
    "critic.ppo_mini_batch_size": 2,
    "critic.ppo_micro_batch_size_per_gpu": 2,
    "critic.forward_micro_batch_size_per_gpu": 4,
    "critic.use_remove_padding": "true",
}
MULTI_TURN = {  # trajectories of the guess_number environment: assistant and environment tokens in one response
    "rollout.multi_turn.enable": "true",
    "env.path": "guess_number",
    "env.kwargs.max_turns": 3,
    "rollout.multi_turn.max_tokens_per_turn": 4,
    "data.max_response_length": 16,  # a trajectory still fits one micro-batch's 80 tokens
}
SP2 = {
    "actor.ulysses_sequence_parallel_size": 2,
    "ref.ulysses_sequence_parallel_size": 2,
    "actor.ppo_max_token_len_per_gpu": 40,
    "actor.log_prob_max_token_len_per_gpu": 40,
}


@pytest.mark.parametrize(
    ("extra", "two_ranks_only"),
    [
        (PACKED_DYNAMIC, {}),
        (CRITIC, {}),
        ({**PACKED_DYNAMIC, **MULTI_TURN}, {}),
        # 2 ranks = one DP rank of two SP ranks; per-GPU token budgets halve so each micro-batch is the same.
        ({**PACKED_DYNAMIC, "actor.use_kl_loss": "true"}, SP2),
        # LoRA under FSDP2: only adapters train; the reference is the actor with adapters disabled.
        (
            {
                "model.lora_rank": 8,
                "model.lora_alpha": 16,
                "actor.use_kl_loss": "true",
                "actor.entropy_coeff": 0.1,
                "actor.optim.lr": 1e-2,
            },
            {},
        ),
    ],
    ids=[
        "grpo-packed-dynamic",
        "ppo-critic",
        "multi-turn-packed-dynamic",
        "ulysses-sp2-packed-kl",
        "lora-kl",
    ],
)
def test_two_ranks_train_like_one(tmp_path, tiny_model_dir, extra, two_ranks_only):
    one = tmp_path / "one"
    _run(1, tmp_path / "o1", _options(tiny_model_dir, one, **extra))
    two = tmp_path / "two"
    _run(2, tmp_path / "o2", _options(tiny_model_dir, two, **{**extra, **two_ranks_only}))
    _same_training(_metrics(one), _metrics(two))


def test_checkpoint_moves_between_world_sizes(tmp_path, tiny_model_dir):
    """Steps 1-2 on 2 ranks, then 3-4 on 1 rank (and the reverse) = 4 uninterrupted steps on 1 rank."""
    straight = tmp_path / "straight"
    _run(1, tmp_path / "o0", _options(tiny_model_dir, straight, **{"trainer.total_steps": 4}))
    for first, second in ((2, 1), (1, 2)):
        run = tmp_path / f"w{first}{second}"
        _run(first, tmp_path / f"o{first}a", _options(tiny_model_dir, run))
        assert (run / "checkpoints" / "step_000002" / "COMPLETE").exists()
        _run(second, tmp_path / f"o{first}b", _options(tiny_model_dir, run, **{"trainer.total_steps": 4}))
        _same_training(
            [m for m in _metrics(straight) if m["step"] > 2], [m for m in _metrics(run) if m["step"] > 2]
        )


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    """The pid of the worker with RANK=rank among the launcher's children (read from /proc)."""
    for child in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split():
        try:
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return int(child)
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds worker pids through /proc")
@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_dead_or_hung_rank_ends_the_job(tmp_path, tiny_model_dir, how):
    run_dir = tmp_path / "run"
    options = _options(tiny_model_dir, run_dir, **{"trainer.total_steps": 50, "trainer.dist_timeout_s": 8})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(WORKERS),
        "train",
        str(tmp_path / "out"),
        *[f"{k}={v}" for k, v in options.items()],
    ]
    (tmp_path / "out").mkdir()
    launcher = start_group(
        cmd, env=loopback_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "metrics.jsonl").exists() or len(_metrics(run_dir)) < 2:
            assert launcher.poll() is None, launcher.stdout.read()
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.5)
        pid = _rank_pid(launcher, 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        stopped = time.monotonic()
        output, _ = launcher.communicate(timeout=120)
        took = time.monotonic() - stopped
    finally:
        if launcher.poll() is None:
            launcher.kill()
        end_group(launcher)  # the ranks too
    assert launcher.returncode != 0
    assert took < 8 + 60, f"the job took {took:.0f} s to stop"
    if how == "killed":
        assert "rank      : 1" in output and "SIGKILL" in output, output[-3000:]
    else:
        assert "another rank has probably died or hung" in output, output[-3000:]
        assert "trainer.dist_timeout_s=8" in output


def test_sharded_checkpoint_loads_in_one_process(tmp_path, tiny_model_dir):
    """A checkpoint written by 2 ranks is an ordinary checkpoint for `posttrain eval` (one process): its actor
    weights equal the final export gathered at the end of the 2-rank run."""
    from posttrain.models.hf import load_causal_lm
    from posttrain.train.checkpoint import find_checkpoint, load_module_weights

    run = tmp_path / "run"
    # The entropy bonus moves the weights even when every reward is 0 (a random tiny model).
    extra = {"trainer.total_steps": 1, "trainer.export_hf": "true", "actor.entropy_coeff": 0.1}
    _run(2, tmp_path / "o", _options(tiny_model_dir, run, **extra))
    model = load_causal_lm(tiny_model_dir, "fp32", "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    load_module_weights(find_checkpoint(run, "auto"), "actor", model)
    exported = load_causal_lm(run / "final_model", "fp32", "cpu").state_dict()
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    for name, value in model.state_dict().items():
        assert torch.equal(exported[name], value), name


def test_distillation_on_two_ranks_trains_like_one(tmp_path, tiny_model_dir, teacher_model_dir):
    """GRPO + OPD with packed, token-budgeted passes: the teacher sharded like the reference over 2 ranks gives
    the 1-rank step's distill/* metrics and losses (its sums cross ranks once per step)."""
    extra = {
        **PACKED_DYNAMIC,
        "distill.teacher.path": str(teacher_model_dir),
        "distill.opd_coef": 0.5,
        "distill.top_k": 100,
        "distill.teacher.log_prob_max_token_len_per_gpu": 80,
    }
    one, two = tmp_path / "one", tmp_path / "two"
    _run(1, tmp_path / "o1", _options(tiny_model_dir, one, **extra))
    _run(2, tmp_path / "o2", _options(tiny_model_dir, two, **extra))
    a, b = _metrics(one), _metrics(two)
    _same_training(a, b)
    steps = [(ma, mb) for ma, mb in zip(a, b) if "distill/reverse_kl" in ma]
    assert len(steps) == 2
    for ma, mb in steps:
        for key in (
            "distill/reverse_kl",
            "distill/teacher_logprob",
            "distill/advantage_mean",
            "distill/top_k_overlap",
        ):
            assert mb[key] == pytest.approx(ma[key], rel=1e-4, abs=1e-6), (ma["step"], key)
