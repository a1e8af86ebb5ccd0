"""The built-in code reward, run in the real sandbox on the tiny code dataset's formats."""

import json
from pathlib import Path

import pytest

from posttrain.config.errors import ConfigError
from posttrain.config.schema.sandbox import SandboxConfig
from posttrain.rewards import RewardInput, RewardRunner, resolve_reward_function
from posttrain.rewards.code import COUNTS, CodeReward, extract_code
from posttrain.sandbox.build import RunSandbox, Sandbox

ROWS = [json.loads(line) for line in (Path(__file__).parents[2] / "examples/code/tiny_code.jsonl").open()]
SUM = ROWS[0]["answer"]  # stdin/stdout: a + b
ADD = ROWS[3]["answer"]  # call-based: add(a, b)


@pytest.fixture(scope="module")
def reward(sandbox):
    return CodeReward(Sandbox(sandbox, max_concurrent=2))


def block(code: str) -> str:
    return f"Here is my answer:\n```python\n{code}\n```\nDone."


def test_extract_code_takes_the_last_python_block():
    text = "```\nnot this\n```\n```python\nprint(1)\n```\n```text\nout\n```"
    assert extract_code(text) == "print(1)"
    assert extract_code("print(2)") == "print(2)"


def test_stdin_stdout_cases(reward):
    assert reward("", block("a, b = map(int, input().split())\nprint(a + b)"), SUM, {}) == 1.0
    assert reward(
        "", block("a, b = map(int, input().split())\nprint(a + b if a else 99)"), SUM, {}
    ) == pytest.approx(2 / 3)
    reward_all = CodeReward(reward.sandbox, mode="all_or_nothing")
    assert (
        reward_all("", block("a, b = map(int, input().split())\nprint(a + b if a else 99)"), SUM, {}) == 0.0
    )


def test_call_based_cases_and_a_solution_class(reward):
    assert reward("", block("def add(a, b):\n    return a + b"), ADD, {}) == 1.0
    leetcode = "class Solution:\n    def add(self, a, b):\n        return a + b if a > 1 else -1"
    assert reward("", block(leetcode), ADD, {}) == pytest.approx(1 / 3)


def test_compile_errors_and_timeouts_score_zero_and_are_counted(sandbox):
    reward = CodeReward(Sandbox(sandbox, max_concurrent=2))
    before = COUNTS.copy()
    assert reward("", block("def add(a, b) return a + b"), ADD, {}) == 0.0
    assert COUNTS["compile_errors"] - before["compile_errors"] == 1
    assert COUNTS["cases"] - before["cases"] == 1  # not run on the other cases
    slow = CodeReward(Sandbox(sandbox.__class__(sandbox.limits.__class__(time_limit_s=1)), 2))
    assert slow("", block("while True: pass"), SUM, {}) == 0.0
    assert COUNTS["time_limits"] - before["time_limits"] == 3


def test_malformed_test_cases_are_a_config_error(reward):
    with pytest.raises(ConfigError, match="one output per input"):
        reward("", "print(1)", json.dumps({"inputs": ["1"], "outputs": []}), {})
    with pytest.raises(ConfigError, match="needs test cases"):
        reward("", "print(1)", None, {})


def test_code_is_a_built_in_reward_over_the_runs_sandbox(sandbox):
    run_sandbox = RunSandbox(SandboxConfig(max_concurrent=2, time_limit_s=5))
    fn = resolve_reward_function("code", sandbox=run_sandbox)
    assert fn.sandbox is run_sandbox.get()
    with pytest.raises(ValueError, match="pass the run's sandbox"):
        resolve_reward_function("code")
    assert (
        fn(
            "",
            block("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)"),
            ROWS[5]["answer"],
            {},
        )
        == 1.0
    )


def test_the_code_reward_behind_the_guarded_runner(sandbox):
    run_sandbox = RunSandbox(SandboxConfig(max_concurrent=2, time_limit_s=5))
    samples = [
        RewardInput("", block("def add(a, b):\n    return a + b"), ADD),
        RewardInput("", block("def add(a, b):\n    return a - b"), ADD),  # wrong on every case
        RewardInput("", "no code here, just words", SUM),
    ]
    with RewardRunner(
        resolve_reward_function("code", sandbox=run_sandbox), timeout_s=60
    ) as runner:  # a worker
        rewards, _ = runner.score(samples)
    assert rewards == [1.0, 0.0, 0.0]


def test_verl_code_sources_run_their_test_cases_in_the_sandbox(sandbox, tmp_path):
    """A verl-layout file mixing APPS/CodeContests-style code rows with GSM8K rows: no reward function given,
    each row is scored by its data_source, the code ones by running the program in the real sandbox."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from posttrain.config.load import build_config
    from posttrain.data.scorers import CODE_SOURCES
    from posttrain.data.splits import load_splits
    from posttrain.rl.build import build_reward_runner

    assert {"codecontests", "apps", "codeforces", "taco"} <= set(CODE_SOURCES)

    def row(source, ground_truth):
        return {
            "data_source": source,
            "prompt": [{"role": "user", "content": "Solve it."}],
            "ability": "code" if source != "openai/gsm8k" else "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {"split": "train", "index": 0},
        }

    rows = [row("apps", SUM), row("codecontests", ADD), row("taco", SUM), row("openai/gsm8k", "5")]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = build_config(overrides=[f"data.train_files=[{path}]", "reward.function=", "sandbox.time_limit_s=5"])
    splits = load_splits(cfg)
    assert splits.reward_spec == "data_source_code"
    programs = [
        block("a, b = map(int, input().split())\nprint(a + b)"),  # apps: right on every case
        block("def add(a, b):\n    return a + b"),  # codecontests, call-based: right
        block("a, b = map(int, input().split())\nprint(a + b if a else 99)"),  # taco: 2 of 3 cases
        "so #### 5",  # gsm8k: the math scorer, no sandbox
    ]
    samples = [
        RewardInput("", p, r.ground_truth, r.extra) for p, r in zip(programs, splits.train, strict=True)
    ]
    with build_reward_runner(cfg, splits.reward_spec, splits.data_source) as runner:
        rewards, metrics = runner.score(samples)
    assert rewards == pytest.approx([1.0, 1.0, 2 / 3, 1.0])
    assert metrics["reward/num_failures"] == 0
