"""RewardRunner: failures, timeouts, crashes and fail_fast never take the run down silently."""

import logging
import math
import os
import time

import pytest

from posttrain.rewards.functions import resolve_reward_function
from posttrain.rewards.runner import RewardFunctionError, RewardInput, RewardRunner


def reward(prompt, response, ground_truth, extra):
    """Behaves according to the response, so one batch can mix good and bad samples."""
    if response == "raise":
        return 1 / 0
    if response == "hang":
        time.sleep(10)
    if response == "nan":
        return math.nan
    if response == "str":
        return "1.0"
    if response == "crash":
        os._exit(3)
    return float(len(response))


def samples(*responses):
    return [RewardInput(prompt="p", response=r, ground_truth=None, extra={}) for r in responses]


@pytest.fixture(params=[None, 5.0], ids=["in_process", "workers"])
def timeout_s(request):
    return request.param


def test_scores_in_order(timeout_s):
    responses = [str(i) * (i % 7) for i in range(50)]
    with RewardRunner(reward, timeout_s=timeout_s, num_workers=3) as runner:
        rewards, metrics = runner.score(samples(*responses))
        assert rewards == [float(len(r)) for r in responses]
        assert metrics["reward/num_failures"] == 0 and metrics["reward/num_timeouts"] == 0
        assert runner.score([])[0] == []


def test_exception_gives_failure_reward_and_logs_first_traceback_once(timeout_s, caplog):
    runner = RewardRunner(reward, timeout_s=timeout_s, failure_reward=-1.0)
    with runner, caplog.at_level(logging.WARNING, logger="posttrain.rewards"):
        rewards, metrics = runner.score(samples("ab", "raise", "abc", "raise"))
        rewards2, _ = runner.score(samples("raise"))
    assert rewards == [2.0, -1.0, 3.0, -1.0] and rewards2 == [-1.0]
    assert metrics["reward/num_failures"] == 2 and metrics["reward/num_timeouts"] == 0
    logged = [r for r in caplog.records if r.name == "posttrain.rewards"]
    assert len(logged) == 1
    assert "ZeroDivisionError" in logged[0].getMessage() and "Traceback" in logged[0].getMessage()
    assert "ZeroDivisionError" in runner.first_error


def test_bad_return_values_are_failures(timeout_s):
    with RewardRunner(reward, timeout_s=timeout_s) as runner:
        rewards, metrics = runner.score(samples("nan", "str", "a"))
    assert rewards == [0.0, 0.0, 1.0]
    assert metrics["reward/num_failures"] == 2
    assert "nan" in runner.first_error


def test_hung_function_is_abandoned_and_later_samples_scored():
    start = time.monotonic()
    with RewardRunner(reward, timeout_s=0.5, failure_reward=-1.0) as runner:
        rewards, metrics = runner.score(samples("a", "hang", "bb", "ccc"))
    assert time.monotonic() - start < 3.0
    assert rewards == [1.0, -1.0, 2.0, 3.0]
    assert metrics["reward/num_timeouts"] == 1 and metrics["reward/num_failures"] == 1
    assert "timed out after 0.5 s" in runner.first_error


def test_timeouts_in_several_workers():
    start = time.monotonic()
    with RewardRunner(reward, timeout_s=0.5, num_workers=2) as runner:
        rewards, metrics = runner.score(samples("hang", "a", "bb", "hang"))
        assert rewards == [0.0, 1.0, 2.0, 0.0]
        assert metrics["reward/num_timeouts"] == 2
        # Replacement workers serve the next call.
        assert runner.score(samples("a", "bb"))[0] == [1.0, 2.0]
    assert time.monotonic() - start < 3.0


def test_a_reward_that_hangs_on_every_sample_costs_its_timeout_about_twice_per_batch():
    """Drill: 32 hung samples at reward.timeout_s=2 took 66 s, the timeouts one after another. After the
    first timeout the rest run one per process, together."""
    start = time.monotonic()
    with RewardRunner(reward, timeout_s=1.0, failure_reward=-1.0) as runner:
        rewards, metrics = runner.score(samples(*["hang"] * 12, "bb"))
        took = time.monotonic() - start
        assert rewards == [-1.0] * 12 + [2.0]
        assert metrics["reward/num_timeouts"] == 12 and metrics["reward/num_failures"] == 12
        assert runner.score(samples("a", "bb"))[0] == [1.0, 2.0]  # the worker is back for the next call
    assert took < 6.0, f"{took:.1f} s: the timeouts ran one after another (12 s)"


def test_crashed_worker_is_replaced():
    with RewardRunner(reward, timeout_s=5.0) as runner:
        rewards, metrics = runner.score(samples("a", "crash", "bb"))
    assert rewards == [1.0, 0.0, 2.0]
    assert metrics["reward/num_failures"] == 1
    assert "exit code 3" in runner.first_error


def test_fail_fast_raises_with_traceback(timeout_s):
    runner = RewardRunner(reward, timeout_s=timeout_s, fail_fast=True)
    with pytest.raises(RewardFunctionError, match=r"(?s)sample 1 .*fail_fast=true.*ZeroDivisionError"):
        runner.score(samples("a", "raise", "bb"))
    # The runner is still usable, and no answer of the aborted call leaks into the next one.
    assert runner.score(samples("ccc", "d"))[0] == [3.0, 1.0]
    runner.close()


def test_fail_fast_on_timeout():
    with (
        RewardRunner(reward, timeout_s=0.3, fail_fast=True) as runner,
        pytest.raises(RewardFunctionError, match="timed out"),
    ):
        runner.score(samples("hang"))


def test_user_function_from_file(tmp_path):
    path = tmp_path / "user_reward.py"
    path.write_text(
        "def score(prompt, response, ground_truth, extra):\n    return float(response == ground_truth)\n"
    )
    fn = resolve_reward_function(f"{path}:score")
    inputs = [RewardInput("p", "4", "4", {}), RewardInput("p", "5", "4", {})]
    with RewardRunner(fn, timeout_s=5.0) as runner:
        assert runner.score(inputs)[0] == [1.0, 0.0]


def test_close_stops_workers():
    runner = RewardRunner(reward, timeout_s=5.0, num_workers=2)
    runner.score(samples("a", "b"))
    processes = [w.process for w in runner._workers]
    assert all(p.is_alive() for p in processes)
    runner.close()
    assert not any(p.is_alive() for p in processes)


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s=-1"):
        RewardRunner(reward, timeout_s=-1)
    with pytest.raises(ValueError, match="num_workers=0"):
        RewardRunner(reward, timeout_s=1, num_workers=0)
