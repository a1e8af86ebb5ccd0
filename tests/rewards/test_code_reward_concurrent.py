"""The code reward scores a step's samples at once (their programs share the sandbox's ``max_concurrent``
slots): the same rewards and the same ``reward/code/*`` counts as one sample at a time, in whatever order the
samples end, in this process and in a worker process."""

import json
import multiprocessing
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from posttrain.rewards import RewardInput, RewardRunner
from posttrain.rewards.code import CodeReward
from posttrain.sandbox import LocalSandbox, RunRequest
from posttrain.sandbox.build import Sandbox
from tests.sandbox_support import TIGHT

DATA = Path(__file__).parents[2] / "examples/code/tiny_code.jsonl"
ROWS = [json.loads(line)["answer"] for line in DATA.open()]
SUM, REVERSE, COUNT, ADD = ROWS[0], ROWS[1], ROWS[2], ROWS[3]


def block(code: str) -> str:
    return f"```python\n{code}\n```"


BATCH = [
    # first and slowest: every case sleeps, so the samples after it end before it
    RewardInput(
        "", block("import time\ntime.sleep(0.5)\na, b = map(int, input().split())\nprint(a + b)"), SUM
    ),
    RewardInput("", block("print(input()[::-1])"), REVERSE),  # right
    RewardInput("", block("print(input())"), REVERSE),  # wrong on some cases
    RewardInput("", block("for i in range(int(input())):\n    print(i)"), COUNT),  # off by one
    RewardInput("", block("def add(a, b) return a + b"), ADD),  # does not compile: one run
    RewardInput("", block("def add(a, b):\n    return a + b"), ADD),  # right, call-based
    RewardInput("", block("while True:\n    pass"), SUM),  # time limits
    RewardInput("", "", SUM),  # no code
]


class Recorded:
    """The code reward, noting the order its calls end in."""

    def __init__(self, reward: CodeReward) -> None:
        self.reward, self.ended, self.lock = reward, [], threading.Lock()
        self.samples_at_once = reward.samples_at_once

    def __call__(self, prompt, response, ground_truth, extra):
        value = self.reward(prompt, response, ground_truth, extra)
        with self.lock:
            self.ended.append(response)
        return value


@pytest.mark.parametrize("timeout_s", [0, 60], ids=["in_process", "workers"])
def test_at_once_equals_one_at_a_time(sandbox, timeout_s):
    box = Sandbox(LocalSandbox(replace(TIGHT, time_limit_s=1.0)), max_concurrent=4)
    reward = CodeReward(box)
    one_at_a_time = lambda *args: reward(*args)  # noqa: E731  (no samples_at_once: the runner's old way)
    together = Recorded(reward)
    assert together.samples_at_once() == 4
    with RewardRunner(one_at_a_time, timeout_s=timeout_s) as runner:
        alone_rewards, alone = runner.score(BATCH)
    with RewardRunner(together, timeout_s=timeout_s) as runner:
        rewards, metrics = runner.score(BATCH)
    box.close()
    assert rewards == alone_rewards
    assert rewards[:2] == [1.0, 1.0] and rewards[4:] == [0.0, 1.0, 0.0, 0.0] and 0 < rewards[2] < 1
    code = {k: v for k, v in metrics.items() if k.startswith("reward/code/")}
    assert code == {k: v for k, v in alone.items() if k.startswith("reward/code/")}
    assert code["reward/code/compile_errors"] == 1 and code["reward/code/time_limits"] == 3
    assert code["reward/code/no_code"] == 1 and code["reward/code/samples"] == 7
    if not timeout_s:  # in this process the calls can be watched: the first sample ended after others
        assert together.ended[0] != BATCH[0].response


def _run_two(box, queue):
    queue.put([r.stdout for r in box.run_many([RunRequest("print(2)")] * 2)])


def test_a_sandbox_used_before_a_fork_runs_in_the_forked_worker(sandbox):
    """A reward worker forked after the trainer ran the sandbox inherits its thread pool without the threads."""
    box = Sandbox(sandbox, max_concurrent=2)
    assert [r.stdout for r in box.run_many([RunRequest("print(1)")] * 2)] == ["1\n", "1\n"]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_run_two, args=(box, queue))
    child.start()
    child.join(30)
    if child.is_alive():
        child.kill()
    box.close()
    assert child.exitcode == 0 and queue.get(timeout=5) == ["2\n", "2\n"]
