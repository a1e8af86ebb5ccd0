"""Bad input to `posttrain train`: clear errors before heavy work; reward failures do not kill a run."""

import json
import subprocess
import sys

import pytest

from posttrain.rewards.runner import RewardFunctionError
from posttrain.rl.train_command import run_training
from tests.helpers import read_metrics, small_config


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "posttrain", *args], capture_output=True, text=True, timeout=300, env=env
    )


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture
def data_args(tiny_model_dir, tmp_path):
    return [
        f"model.path={tiny_model_dir}",
        f"trainer.run_dir={tmp_path / 'run'}",
        "reward.function=exact_match",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2",
        "rollout.n=2",
        "actor.ppo_micro_batch_size_per_gpu=2",
    ]


def test_malformed_row_names_file_row_and_field(tmp_path, data_args):
    data = write_jsonl(
        tmp_path / "train.jsonl", [{"prompt": "What is 1 + 1?", "answer": "2"}, {"question": "x"}]
    )
    out = run_cli("train", f"data.train_files=[{data}]", *data_args)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    for fragment in ("train.jsonl", "row 1", "prompt"):
        assert fragment in out.stderr


def test_missing_file_is_a_clear_error(tmp_path, data_args):
    out = run_cli("train", f"data.train_files=[{tmp_path / 'nope.jsonl'}]", *data_args)
    assert out.returncode == 2 and "nope.jsonl" in out.stderr and "Traceback" not in out.stderr


def test_overlong_prompts_filtered_or_rejected(tmp_path, data_args):
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}] * 4 + [{"prompt": "long " * 200, "answer": "x"}]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    out = run_cli("train", f"data.train_files=[{data}]", "data.overlong_prompts=error", *data_args)
    assert out.returncode == 2
    assert "row 4" in out.stderr and "max_prompt_length" in out.stderr


def test_reward_function_without_files_is_named(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "hi", "answer": "x"}] * 4)
    out = run_cli("train", f"data.train_files=[{data}]", f"model.path={tiny_model_dir}")
    assert out.returncode == 2 and "reward.function" in out.stderr


@pytest.mark.long
def test_bad_model_path(tmp_path):
    out = run_cli("train", f"model.path={tmp_path}")
    assert out.returncode == 2 and "model.path" in out.stderr and "Traceback" not in out.stderr


FLAKY_REWARD = """
import time

def flaky(prompt, response, ground_truth, extra):
    n = len(response)
    if n % 4 == 0:
        raise RuntimeError("reward service unavailable")
    if n % 4 == 1:
        time.sleep(5)
    return float(n % 3)
"""


def test_reward_exceptions_and_timeouts_do_not_kill_the_run(tiny_model_dir, tmp_path, capsys):
    reward = tmp_path / "flaky.py"
    reward.write_text(FLAKY_REWARD)
    cfg = small_config(
        tiny_model_dir,
        tmp_path / "run",
        f"reward.function={reward}:flaky",
        "reward.timeout_s=0.3",
        "reward.failure_reward=-1",
        "trainer.total_steps=1",
    )
    run_training(cfg, quiet=False)
    metrics = read_metrics(tmp_path / "run")[-1]
    assert metrics["reward/num_failures"] > 0
    assert metrics["reward/num_timeouts"] > 0
    assert metrics["reward/num_failures"] >= metrics["reward/num_timeouts"]
    summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Reward failures:")]
    assert summary == [
        f"Reward failures: {metrics['reward/num_failures']:.0f} samples over 1 step, "
        f"{metrics['reward/num_timeouts']:.0f} of them timeouts were given reward.failure_reward (the first "
        "message of each kind is in the log; per step in metrics.jsonl)"
    ]


def test_fail_fast_aborts(tiny_model_dir, tmp_path):
    reward = tmp_path / "broken.py"
    reward.write_text("def broken(prompt, response, ground_truth, extra):\n    raise KeyError('oops')\n")
    cfg = small_config(
        tiny_model_dir, tmp_path / "run", f"reward.function={reward}:broken", "reward.fail_fast=true"
    )
    with pytest.raises(RewardFunctionError, match="oops"):
        run_training(cfg, quiet=True)


def test_sft_bad_rows_are_reported(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "What is 1 + 1?", "response": "2"}, {"prompt": 3}])
    out = run_cli(
        "sft", f"model.path={tiny_model_dir}", f"sft.train_files=[{data}]", f"trainer.run_dir={tmp_path}"
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "sft.jsonl" in out.stderr and "row 1" in out.stderr
