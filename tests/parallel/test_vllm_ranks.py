"""Two torchrun ranks (gloo), each with its own in-process vLLM engine, train like one process: every sample is
seeded by its global id, so the ranks' shares are the one process's samples (`pytest -m vllm`)."""

import json
import subprocess
import sys

import pytest

from tests.helpers import VOWELS_REWARD
from tests.parallel.conftest import REPO, free_port, loopback_env

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.dist, pytest.mark.timeout(1200)]


def run(model_dir, run_dir, nproc: int) -> list[dict]:
    reward = run_dir.parent / "vowels.py"
    reward.write_text(VOWELS_REWARD)
    args = [
        "-m",
        "posttrain",
        "train",
        f"model.path={model_dir}",
        f"trainer.run_dir={run_dir}",
        "trainer.total_steps=2",
        "trainer.test_freq=0",
        "trainer.loggers=jsonl",
        "data.train_batch_size=8",
        "data.max_response_length=16",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=8",
        "actor.log_prob_micro_batch_size_per_gpu=16",
        f"reward.function={reward}:vowels",
        "reward.timeout_s=0",
        "rollout.name=vllm",
        "rollout.enable_chunked_prefill=false",
    ]
    if nproc > 1:
        launch = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1"]
        args = [*launch, f"--master_port={free_port()}", *args]
    env = loopback_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_with_their_own_engines_train_like_one(vllm_model_dir, tmp_path):
    one, two = run(vllm_model_dir, tmp_path / "one", 1), run(vllm_model_dir, tmp_path / "two", 2)
    for a, b in zip(one, two, strict=True):
        # The same samples: identical lengths and finishes, and the same rewards (their mean to float32 rounding:
        # two ranks combine their shares' means in float64); the update equals up to float summation order.
        for key in ("response_length/mean", "finish/eos"):
            assert a[key] == b[key], key
        assert b["reward/mean"] == pytest.approx(a["reward/mean"], rel=1e-6)
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        assert b["rollout/sync_bytes"] > 0
