"""Environment calls are bounded and their failures are one message naming class, method and row.

Drills (before): a step or reset that hung hung the run (no timeout); an environment that raised gave 22-25
frames in two chained tracebacks; one that returned the wrong type failed deep in the driver
(`AttributeError: 'dict' object has no attribute 'reward'`); data.task=guess_number ignored env.kwargs
(high=abc, low=50 high=10, max_turns=1) without a word.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from posttrain.agents.driver import EnvironmentFailure, Generation, run_trajectories
from posttrain.agents.env import Environment, StepResult
from posttrain.cli import main
from posttrain.config.errors import ConfigError
from posttrain.models.tiny import build_tiny_tokenizer
from tests.helpers import multi_turn_settings, small_overrides


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def reply_x(tok):
    def generate(requests):
        ids = tok("x", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return [Generation(ids, [0.0] * len(ids), "stop") for _ in requests]

    return generate


class HangsInStep(Environment):
    def step(self, text):
        time.sleep(30)


class HangsInAsyncStep(Environment):
    async def step(self, text):
        await asyncio.sleep(30)


class HangsInReset(Environment):
    def reset(self, row):
        time.sleep(30)


def _run(tok, env_class, rows=2, **settings):
    make = lambda row: env_class() if row["prompt"] == "b" else Environment()  # noqa: E731
    prompts = [{"prompt": p} for p in "ab"[:rows]]
    return run_trajectories(prompts, make, reply_x(tok), tok, multi_turn_settings(**settings))


@pytest.mark.parametrize(
    ("env_class", "method"), [(HangsInStep, "step"), (HangsInAsyncStep, "step"), (HangsInReset, "reset")]
)
def test_a_hung_environment_call_is_an_environment_failure_at_its_timeout(tok, env_class, method):
    start = time.monotonic()
    with pytest.raises(EnvironmentFailure) as info:
        _run(tok, env_class, env_timeout_s=0.5)
    assert time.monotonic() - start < 5.0
    assert (
        f"{env_class.__name__}.{method} did not return within rollout.multi_turn.env_timeout_s=0.5 s on row 1"
        in str(info.value)
    )
    # counted like any environment failure: within max_env_failures the run goes on
    trajs = _run(tok, env_class, env_timeout_s=0.5, max_env_failures=1)
    assert [t.metrics.get("env_failures", 0.0) for t in trajs] == [0.0, 1.0]


def _deep(n):
    if n == 0:
        raise ValueError("the board is full")
    return _deep(n - 1)


class Raises(Environment):
    def step(self, text):
        return _deep(2)


def test_an_environment_that_raises_is_one_message_with_its_own_frames_once(tok):
    with pytest.raises(EnvironmentFailure) as info:
        _run(tok, Raises, env_timeout_s=0)
    message = str(info.value)
    assert message.startswith("environment Raises.step failed on row 1: ValueError: the board is full")
    assert message.count("in _deep") == 3 and message.count("in step") == 1  # its frames, each once
    assert "posttrain/agents" not in message and "asyncio" not in message  # not the driver's frames
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no chained traceback
    assert isinstance(info.value, ConfigError)  # the command line prints it as one error, exit 2
    with pytest.raises(EnvironmentFailure, match="failed on row 1: ValueError: the board is full"):
        _run(tok, Raises, env_timeout_s=5)  # the same through the thread a timeout runs it in


class StepReturnsDict(Environment):
    def step(self, text):
        return {"messages": [], "reward": 1.0, "done": True}


class ResetReturnsText(Environment):
    def reset(self, row):
        return "Welcome!"


@pytest.mark.parametrize(
    ("env_class", "words"),
    [
        (StepReturnsDict, "StepReturnsDict.step returned dict"),
        (ResetReturnsText, "ResetReturnsText.reset returned str 'Welcome!' on row 1; reset must return None"),
    ],
)
def test_an_environment_that_returns_the_wrong_type_is_named(tok, env_class, words):
    with pytest.raises(EnvironmentFailure, match="on row 1") as info:
        _run(tok, env_class)
    assert words in str(info.value)


def test_a_well_behaved_environment_is_unchanged_by_the_timeout(tok):
    class Done(Environment):
        def step(self, text):
            return StepResult(reward=1.0, done=True)

    trajs = _run(tok, Done, env_timeout_s=5)
    assert [t.reward for t in trajs] == [0.0, 1.0]


@pytest.mark.parametrize(
    "kwargs",
    [["env.kwargs.high=abc"], ["env.kwargs.low=50", "env.kwargs.high=10"], ["env.kwargs.max_turns=1"]],
)
def test_env_kwargs_a_task_overrides_are_refused_by_explain_and_train(
    tiny_model_dir, tmp_path, capsys, kwargs
):
    overrides = [*small_overrides(tiny_model_dir, tmp_path / "run"), "data.task=guess_number", *kwargs]
    messages = []
    for command in ("explain", "train"):
        assert main([command, *overrides]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        messages.append(err.split("error: ", 1)[1])
    assert messages[0] == messages[1]
    assert "has no effect with data.task=guess_number" in messages[0] and "data.task_options." in messages[0]


RAISING_ENV = """
from posttrain.agents.env import Environment


def _deep(text):
    raise ValueError("the board is full")


class Raises(Environment):
    def step(self, text):
        return _deep(text)
"""


@pytest.mark.parametrize("max_env_failures", [0, 1000])
def test_train_with_a_raising_environment_ends_with_one_message(
    tiny_model_dir, tmp_path, capsys, max_env_failures
):
    """Exit 2 and one message naming class, method and row with the environment's own frame once; when every
    trajectory failed within max_env_failures, a clear error instead of the update's "response_mask selects no
    token"."""
    (tmp_path / "envs.py").write_text(RAISING_ENV)
    overrides = [
        *small_overrides(tiny_model_dir, tmp_path / "run"),
        "trainer.total_steps=1",
        "data.train_batch_size=2",
        "rollout.n=2",
        "data.max_response_length=16",
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.max_tokens_per_turn=2",  # a turn cut at 2 tokens still gets its environment step
        f"rollout.multi_turn.max_env_failures={max_env_failures}",
        f"env.path={tmp_path / 'envs.py'}:Raises",
    ]
    assert main(["train", *overrides]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "response_mask" not in err
    assert "environment Raises.step failed on row " in err and "ValueError: the board is full" in err
    assert err.count('envs.py", line 6, in _deep') == 1  # the user's own frame, once
    if max_env_failures:
        assert "every trajectory of the step (4) failed in its environment" in err
        assert "rollout.multi_turn.max_env_failures=1000" in err
