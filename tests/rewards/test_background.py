"""Scoring in a background thread, in chunks of what has finished: the same rewards (in sample order) and metrics as
one runner call over every sample; a failing reward fails the step in the caller's thread; a cancelled scoring
leaves the runner usable."""

import threading
import time

import pytest

from posttrain.rewards import counts
from posttrain.rewards.background import WAIT_METRIC, BackgroundScoring, merge_chunk_metrics
from posttrain.rewards.runner import RewardFunctionError, RewardInput, RewardRunner

TIMES = ("reward/time_s", WAIT_METRIC)


def counted(prompt, response, ground_truth, extra):
    """A reward with its own counts (as the code reward keeps them), failing on the response "boom"."""
    counts.add("test", {"calls": 1, "long": int(len(response) > 3)})
    if response == "boom":
        raise ValueError("boom")
    return float(len(response))


counted.samples_at_once = lambda: 2  # several at once in threads, as the code reward

SAMPLES = [RewardInput("p", "x" * k) for k in range(7)] + [RewardInput("p", "boom")]


def untimed(metrics):
    return {k: v for k, v in metrics.items() if k not in TIMES}


@pytest.mark.parametrize("timeout_s", [0, 60], ids=["in_process", "workers"])
def test_chunks_add_up_to_one_call_in_sample_order(timeout_s):
    with RewardRunner(counted, timeout_s=timeout_s, num_workers=2) as runner:
        expected, whole = runner.score(SAMPLES)
        background = BackgroundScoring(runner)
        order = [5, 0, 7, 2, 1, 6, 3, 4]  # the order samples finish in
        for k, index in enumerate(order):
            background.add(index, SAMPLES[index])
            if k % 3 == 0:
                time.sleep(0.05)  # let the thread take a chunk
        rewards, metrics = background.finish(len(SAMPLES))
    assert rewards == expected
    assert untimed(metrics) == untimed(whole)
    assert list(metrics)[:3] == list(whole)[:3]  # the order a single call lists them in
    assert metrics["reward/num_failures"] == 1.0 and metrics["reward/test/calls"] == len(SAMPLES)
    assert metrics[WAIT_METRIC] >= 0.0


def test_merged_metrics_sum_every_count():
    a = {
        "reward/num_failures": 1.0,
        "reward/num_timeouts": 0.0,
        "reward/time_s": 0.5,
        "reward/code/cases": 3.0,
    }
    b = {
        "reward/num_failures": 0.0,
        "reward/num_timeouts": 1.0,
        "reward/time_s": 0.25,
        "reward/code/passed": 2.0,
    }
    assert merge_chunk_metrics([a, b]) == {
        "reward/num_failures": 1.0,
        "reward/num_timeouts": 1.0,
        "reward/time_s": 0.75,
        "reward/code/cases": 3.0,
        "reward/code/passed": 2.0,
    }


@pytest.mark.parametrize("timeout_s", [0, 60], ids=["in_process", "workers"])
@pytest.mark.timeout(120)
def test_a_failing_reward_with_fail_fast_raises_in_the_callers_thread(timeout_s):
    with RewardRunner(counted, timeout_s=timeout_s, fail_fast=True) as runner:
        background = BackgroundScoring(runner)
        background.add(0, RewardInput("p", "boom"))
        time.sleep(0.2)  # it fails while "generation" goes on; later samples are still handed over
        background.add(1, RewardInput("p", "fine"))
        with pytest.raises(RewardFunctionError, match="failed on sample 0") as raised:
            background.finish(2)
        assert "boom" in str(raised.value)
        assert runner.score([RewardInput("p", "ok")])[0] == [2.0]  # the runner is usable after it


@pytest.mark.timeout(60)
def test_messages_name_the_samples_step_index():
    with RewardRunner(counted, timeout_s=0, fail_fast=True) as runner:
        background = BackgroundScoring(runner)
        background.add(3, RewardInput("p", "fine"))
        background.add(6, RewardInput("p", "boom"))
        with pytest.raises(RewardFunctionError, match="failed on sample 6"):
            background.finish(7)


@pytest.mark.timeout(60)
def test_cancel_returns_and_leaves_the_runner_free():
    started, release = threading.Event(), threading.Event()

    def slow(prompt, response, ground_truth, extra):
        started.set()
        release.wait(10)
        return 1.0

    with RewardRunner(slow, timeout_s=0) as runner:
        background = BackgroundScoring(runner)
        background.add(0, RewardInput("p", "a"))
        started.wait(10)
        background.add(1, RewardInput("p", "b"))  # queued: dropped by the cancel
        threading.Timer(0.2, release.set).start()
        background.cancel()  # waits for the chunk being scored, scores no more
        assert not background._thread.is_alive()
        assert runner.score([RewardInput("p", "c")])[0] == [1.0]


def test_a_result_with_samples_never_reported_is_an_error():
    with RewardRunner(counted, timeout_s=0) as runner:
        background = BackgroundScoring(runner)
        background.add(0, RewardInput("p", "a"))
        with pytest.raises(RuntimeError, match="report each sample"):
            background.finish(2)


def test_no_sample_gives_the_metrics_of_an_empty_call():
    with RewardRunner(counted, timeout_s=0) as runner:
        rewards, metrics = BackgroundScoring(runner).finish(0)
        assert rewards == [] and untimed(metrics) == untimed(runner.score([])[1])
