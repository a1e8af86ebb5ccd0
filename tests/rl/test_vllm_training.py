"""`posttrain train rollout.name=vllm` end to end against the real vLLM (CPU build, its own environment:
`pytest -m vllm`): it learns like the native engine does, with weights pushed after every update and the
rollout–training mismatch metrics and importance weights logged."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import VOWELS_REWARD

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def train(model_dir: Path, run_dir: Path, *extra: str) -> list[dict]:
    reward = run_dir.parent / "vowels.py"
    reward.write_text(VOWELS_REWARD)
    overrides = [
        f"model.path={model_dir}",
        f"trainer.run_dir={run_dir}",
        "trainer.total_steps=10",
        "trainer.test_freq=0",
        "trainer.loggers=jsonl",
        "data.train_batch_size=8",
        "data.max_response_length=16",
        "rollout.n=8",
        "actor.ppo_mini_batch_size=8",
        "actor.ppo_micro_batch_size_per_gpu=64",
        "actor.log_prob_micro_batch_size_per_gpu=64",
        "actor.optim.lr=1e-2",
        "actor.optim.lr_schedule=constant",
        f"reward.function={reward}:vowels",
        "reward.timeout_s=0",
        "rollout.enable_chunked_prefill=false",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out = subprocess.run(
        [sys.executable, "-m", "posttrain", "train", *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _gain(rows: list[dict]) -> float:
    rewards = [r["reward/mean"] for r in rows]
    return sum(rewards[-2:]) / 2 - sum(rewards[:2]) / 2


def test_vllm_rollout_learns_like_the_native_engine(vllm_model_dir, tmp_path):
    native = train(vllm_model_dir, tmp_path / "native")
    vllm = train(
        vllm_model_dir,
        tmp_path / "vllm",
        "rollout.name=vllm",
        "algorithm.rollout_correction.rollout_is=token",
    )
    # The same task and settings learn with either engine (different draws: the engines' noise differs).
    assert _gain(native) > 0.2, [r["reward/mean"] for r in native]
    assert _gain(vllm) > 0.2, [r["reward/mean"] for r in vllm]
    for row in vllm:
        # Every update is pushed into vLLM; the engine and the trainer agree on the sampled tokens' log-probs.
        assert row["rollout/sync_bytes"] > 0 and row["timing/sync_weights"] > 0
        assert row["rollout_corr/log_prob_abs_diff_max"] < 1e-4
        assert row["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
        assert "rollout/tokens_per_s" in row


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "adapter-only"])
def test_vllm_follows_a_lora_policy(vllm_model_dir, tmp_path, merge):
    """After each update vLLM decodes the updated LoRA policy, pushed merged or as the adapter alone: its
    log-probs of the sampled tokens stay the trainer's (a stale engine would drift from step 2 on)."""
    rows = train(
        vllm_model_dir,
        tmp_path / "run",
        "rollout.name=vllm",
        "trainer.total_steps=3",
        "model.lora_rank=8",
        "model.lora_alpha=32",
        f"model.lora_merge={str(merge).lower()}",
        # Keeps the old-log-prob pass (one optimizer step per rollout would skip it): the maximum below is
        # a whole-batch statistic, reported by the correction step. The weights stay 1 when the engine follows.
        "algorithm.rollout_correction.rollout_is=token",
    )
    assert len(rows) == 3
    for row in rows:
        assert row["rollout_corr/log_prob_abs_diff_max"] < 1e-4, row["step"]
    assert rows[-1]["actor/grad_norm"] > 0


def test_vllm_multi_turn_trajectories_train_with_the_trainers_log_probs(vllm_model_dir, tmp_path):
    """Multi-turn trajectories (guess_number) rolled out by vLLM: several turns per trajectory, environment
    tokens in the response, and the engine's log-probs of the assistant tokens are the trainer's after every
    weight push."""
    rows = train(
        vllm_model_dir,
        tmp_path / "run",
        "rollout.name=vllm",
        "trainer.total_steps=2",
        "rollout.multi_turn.enable=true",
        "env.path=guess_number",
        "rollout.multi_turn.max_tokens_per_turn=4",
        "data.max_response_length=24",
        "algorithm.rollout_correction.rollout_is=token",
    )
    assert len(rows) == 2
    for row in rows:
        assert row["num_turns/max"] > 1 and row["tokens/environment"] > 0
        assert row["rollout_corr/log_prob_abs_diff_max"] < 1e-4, row["step"]


def test_vllm_scoring_during_generation_gives_the_same_steps(vllm_model_dir, tmp_path):
    """Samples scored as vLLM finishes their requests: the same rewards, metrics and weights as scoring after."""
    from safetensors.torch import load_file

    from tests.helpers import untimed

    common = ("rollout.name=vllm", "trainer.total_steps=2", "rollout.max_num_seqs=8")
    off = train(vllm_model_dir, tmp_path / "off", *common, "reward.score_during_generation=never")
    on = train(vllm_model_dir, tmp_path / "on", *common, "reward.score_during_generation=always")
    assert [untimed(m) for m in on] == [untimed(m) for m in off]
    a = load_file(tmp_path / "off" / "final_model" / "model.safetensors")
    b = load_file(tmp_path / "on" / "final_model" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def _safetensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


def test_vllm_rollouts_distilled_from_a_teacher_equal_to_the_student_change_nothing(vllm_model_dir, tmp_path):
    """OPD on vLLM's samples: the teacher pass and the old-log-prob pass are the trainer's, micro-batched alike, so a
    teacher equal to the student gives A = 0 on every token and the final weights are the initial ones bit for bit
    (the engine's own log-probs, which differ by kernel rounding, are not the student's side of A)."""
    rows = train(
        vllm_model_dir,
        tmp_path / "run",
        "rollout.name=vllm",
        "trainer.total_steps=2",
        "algorithm.adv_estimator=opd",
        f"distill.teacher.path={vllm_model_dir}",
        "distill.teacher.log_prob_micro_batch_size_per_gpu=64",
        "algorithm.rollout_correction.rollout_is=token",
    )
    assert [r["distill/reverse_kl"] for r in rows] == [0.0, 0.0]
    start, final = _safetensors(vllm_model_dir), _safetensors(tmp_path / "run" / "final_model")
    assert start.keys() == final.keys() and all(start[k].equal(final[k]) for k in start)


def test_vllm_rollouts_distilled_from_another_teacher_move_toward_it(
    vllm_model_dir, vllm_teacher_dir, tmp_path
):
    """Pure OPD (no reward read) on vLLM's samples: the student's reverse KL to the teacher falls."""
    rows = train(
        vllm_model_dir,
        tmp_path / "run",
        "rollout.name=vllm",
        "trainer.total_steps=6",
        "algorithm.adv_estimator=opd",
        f"distill.teacher.path={vllm_teacher_dir}",
        "actor.optim.lr=3e-3",
    )
    kl = [r["distill/reverse_kl"] for r in rows]
    assert sum(kl[-2:]) < 0.8 * sum(kl[:2]), kl
