"""The code reward's counts (compile errors, time limits, sandbox errors...) reach the step's metrics: through the
reward runner, in process and from forked workers, and through a GRPO step on the tiny code data."""

import json
from pathlib import Path

import pytest

from posttrain.config.schema.sandbox import SandboxConfig
from posttrain.rewards import RewardInput, RewardRunner, resolve_reward_function
from posttrain.rewards.counts import SUMMED
from posttrain.rl.train_command import run_training
from posttrain.sandbox.build import RunSandbox
from tests.helpers import read_metrics, small_config

DATA = Path(__file__).parents[2] / "examples/code/tiny_code.jsonl"
ROWS = [json.loads(line) for line in DATA.open()]
SUM = ROWS[0]["answer"]  # stdin/stdout, three cases: a + b


def block(code: str) -> str:
    return f"```python\n{code}\n```"


@pytest.mark.parametrize("timeout_s", [0, 60], ids=["in_process", "workers"])
def test_counts_of_one_call_come_back_as_metrics(sandbox, timeout_s):
    run_sandbox = RunSandbox(SandboxConfig(max_concurrent=2, time_limit_s=1))
    samples = [
        RewardInput("", block("a, b = map(int, input().split())\nprint(a + b)"), SUM),  # 3 cases passed
        RewardInput("", block("a, b = map(int input().split())"), SUM),  # does not compile: one run
        RewardInput("", block("while True:\n    pass"), SUM),  # three time limits
        RewardInput("", "", SUM),  # no code at all (words alone are taken as the program)
    ]
    fn = resolve_reward_function("code", sandbox=run_sandbox)
    with RewardRunner(fn, timeout_s=timeout_s, num_workers=2) as runner:
        rewards, metrics = runner.score(samples)
        again, second = runner.score(samples[:1])  # counts restart at each call
    assert rewards == [1.0, 0.0, 0.0, 0.0] and again == [1.0]
    code = {k.removeprefix("reward/code/"): v for k, v in metrics.items() if k.startswith("reward/code/")}
    assert code == {
        "samples": 3.0,
        "cases": 7.0,
        "passed": 3.0,
        "no_code": 1.0,
        "compile_errors": 1.0,
        "time_limits": 3.0,
        "memory_limits": 0.0,
        "sandbox_errors": 0.0,
    }
    assert second["reward/code/samples"] == 1.0 and second["reward/code/time_limits"] == 0.0
    assert set(SUMMED) == {f"reward/code/{k}" for k in code}


def test_a_grpo_step_on_the_code_data_reports_the_counts(sandbox, tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    overrides = [f"data.train_files=[{DATA}]", "data.answer_key=answer", "reward.function=code"]
    overrides += ["sandbox.time_limit_s=5", "trainer.total_steps=1", "data.max_prompt_length=256"]
    run_training(small_config(tiny_model_dir, run, *overrides), quiet=True)
    (step,) = read_metrics(run)
    samples = 4 * 4  # data.train_batch_size x rollout.n of the small config
    assert step["reward/code/samples"] + step["reward/code/no_code"] == samples
    for key in SUMMED:
        assert key in step
