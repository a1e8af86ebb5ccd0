"""Reward functions that print, raise KeyboardInterrupt or call sys.exit are contained: output is captured
(first lines logged once), and each such call is a counted failure of that sample."""

from __future__ import annotations

import logging
import sys

import pytest

from posttrain.rewards.runner import RewardInput, RewardRunner


def _chatty(prompt, response, ground_truth, extra):
    for i in range(50):
        print(f"debug line {i} for {response}")
    print("to stderr", file=sys.stderr)
    return 1.0


def _interrupting(prompt, response, ground_truth, extra):
    raise KeyboardInterrupt


def _exiting(prompt, response, ground_truth, extra):
    sys.exit(3)


def _samples(n: int) -> list[RewardInput]:
    return [RewardInput("p", f"r{i}") for i in range(n)]


@pytest.mark.parametrize("timeout_s", [0, 5])
def test_reward_output_is_captured_and_its_first_lines_logged_once(timeout_s, capfd, caplog):
    caplog.set_level(logging.WARNING, logger="posttrain.rewards")
    with RewardRunner(_chatty, timeout_s=timeout_s) as runner:
        rewards, metrics = runner.score(_samples(6))
    assert rewards == [1.0] * 6 and metrics["reward/num_failures"] == 0
    out, err = capfd.readouterr()
    assert "debug line" not in out and "to stderr" not in err  # nothing reached the console directly
    logged = [r.getMessage() for r in caplog.records if "printed output" in r.getMessage()]
    assert len(logged) == 1 and "debug line 0 for r0" in logged[0] and "debug line 10" not in logged[0]


@pytest.mark.parametrize("timeout_s", [0, 5])
def test_keyboard_interrupt_inside_a_reward_is_that_samples_failure(timeout_s, caplog):
    caplog.set_level(logging.WARNING, logger="posttrain.rewards")
    with RewardRunner(_interrupting, timeout_s=timeout_s, failure_reward=-1.0) as runner:
        rewards, metrics = runner.score(_samples(8))
    assert rewards == [-1.0] * 8 and metrics["reward/num_failures"] == 8
    failures = [r.getMessage() for r in caplog.records if "failed on sample" in r.getMessage()]
    assert len(failures) == 1 and "KeyboardInterrupt" in failures[0]  # one log line, not one per sample


@pytest.mark.parametrize("timeout_s", [0, 5])
def test_sys_exit_inside_a_reward_is_a_failure(timeout_s, caplog):
    caplog.set_level(logging.WARNING, logger="posttrain.rewards")
    with RewardRunner(_exiting, timeout_s=timeout_s, failure_reward=-2.0) as runner:
        rewards, metrics = runner.score(_samples(3))
    assert rewards == [-2.0] * 3 and metrics["reward/num_failures"] == 3
    assert any("SystemExit" in r.getMessage() for r in caplog.records)


def test_in_process_rewards_say_what_they_give_up(monkeypatch):
    from posttrain.utils import console

    monkeypatch.setattr(console, "_WARNED", set())
    with pytest.warns(UserWarning, match=r"(?s)gives up the timeout.*isolation from crashes"):
        RewardRunner(_chatty, timeout_s=0).close()
