"""Samples scored at once (a function with ``samples_at_once``): answers in sample order whatever order the
calls end in, each sample's counts exactly once, and the function's own threads only when it asks for them."""

import threading
import time

import pytest

from posttrain.rewards import counts
from posttrain.rewards.many import call_many, samples_at_once
from posttrain.rewards.runner import RewardInput, RewardRunner

ENDED: list[str] = []  # the order calls ended in (in-process runs only)


def slow_first(prompt, response, ground_truth, extra):
    """Sleeps as long as the response says (tenths of a second), counts one `done`, returns the length."""
    if response == "hang":
        time.sleep(30)
    time.sleep(int(response[0]) / 10)
    counts.add("test", {"done": 1, "chars": len(response)})
    ENDED.append(response)
    return float(len(response))


slow_first.samples_at_once = lambda: 4


def one_at_a_time(prompt, response, ground_truth, extra):
    return slow_first(prompt, response, ground_truth, extra)


def samples(*responses):
    return [RewardInput("p", r) for r in responses]


def test_only_functions_that_ask_run_in_threads():
    assert samples_at_once(one_at_a_time) == 1 and samples_at_once(slow_first) == 4
    seen = []
    fn = lambda *args: seen.append(threading.current_thread()) or 1.0  # noqa: E731
    answers = list(call_many(fn, [(i, ("p", "r", None, {})) for i in range(3)]))
    assert [a[0] for a in answers] == [0, 1, 2] and set(seen) == {threading.main_thread()}


@pytest.mark.parametrize("timeout_s", [None, 30.0], ids=["in_process", "workers"])
def test_answers_in_sample_order_with_the_counts_of_one_at_a_time(timeout_s):
    batch = samples("5aaaaa", "1a", "3aaa", "0", "2bb", "1c")
    ENDED.clear()
    with RewardRunner(one_at_a_time, timeout_s=timeout_s) as runner:
        alone, alone_metrics = runner.score(batch)
    with RewardRunner(slow_first, timeout_s=timeout_s) as runner:
        together, together_metrics = runner.score(batch)
    if timeout_s is None:  # in this process: the calls really ended out of order
        assert ENDED[:6] == [s.response for s in batch] and ENDED[6:] != ENDED[:6]
    assert together == alone == [6.0, 2.0, 4.0, 1.0, 3.0, 2.0]
    for name in ("reward/test/done", "reward/test/chars", "reward/num_failures"):
        assert together_metrics[name] == alone_metrics[name]
    assert together_metrics["reward/test/done"] == 6 and together_metrics["reward/test/chars"] == 18
    assert together_metrics["reward/time_s"] < alone_metrics["reward/time_s"]


def test_a_timed_out_sample_does_not_count_the_others_twice():
    """The last two end (and count) before the first is answered, in the worker that is killed when the second
    hangs; the new worker scores them again and only those counts are kept."""
    with RewardRunner(slow_first, timeout_s=0.5) as runner:  # 4 at once: 2 s per answer
        rewards, metrics = runner.score(samples("3a", "hang", "0bb", "0ccc"))
    assert rewards == [2.0, 0.0, 3.0, 4.0]
    assert metrics["reward/num_timeouts"] == 1 and "timed out after 2 s" in runner.first_error
    assert metrics["reward/test/done"] == 3 and metrics["reward/test/chars"] == 9
