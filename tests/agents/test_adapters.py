"""The peers' environments through our interface: a TRL-style class and skyrl-gym's multi-turn GSM8K."""

import asyncio
import re
import time

import pytest

from posttrain.agents.adapters import SkyRLEnvironment, TRLStyleEnvironment
from posttrain.agents.driver import run_trajectories
from posttrain.agents.hermes import tool_call_text
from posttrain.config.errors import ConfigError
from tests.helpers import multi_turn_settings, scripted


class Counter:
    """TRL style: reset(**row), public methods are tools, get_reward() at the end."""

    def reset(self, start: int, **row) -> str:
        self.value = start
        return f"The counter starts at {start}."

    def increment(self, by: int = 1) -> str:
        """Add to the counter.

        Args:
            by: how much to add.
        """
        self.value += by
        return str(self.value)

    async def read(self) -> str:
        """Read the counter."""
        return str(self.value)

    def get_reward(self) -> float:
        return 1.0 if self.value == 10 else 0.0


def counter_policy(conversation: str) -> str:
    if "<tool_response>" not in conversation:
        return tool_call_text("increment", {"by": 3}) + tool_call_text("read", {})
    return "Done."


def test_trl_style_environment(tok):
    rows = [{"prompt": "Make it 10.", "start": 7}, {"prompt": "Make it 10.", "start": 1}]
    envs = []

    def make(row):
        envs.append(TRLStyleEnvironment(Counter()))
        return envs[-1]

    trajs = run_trajectories(rows, make, scripted(tok, counter_policy), tok, multi_turn_settings())
    assert sorted(s["function"]["name"] for s in envs[0].tool_schemas()) == ["increment", "read"]
    schema = next(s for s in envs[0].tool_schemas() if s["function"]["name"] == "increment")["function"]
    assert schema["parameters"]["properties"]["by"] == {"type": "integer", "description": "how much to add."}
    assert [m["role"] for m in trajs[0].messages] == [
        "user",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
    ]
    assert trajs[0].messages[1]["content"] == "The counter starts at 7."
    assert [m["content"] for m in trajs[0].messages[3:5]] == ["10", "10"]
    assert [t.reward for t in trajs] == [1.0, 0.0]
    assert trajs[0].metrics["tool_calls"] == 2.0


def gsm8k_policy(conversation: str) -> str:
    # a wrong answer first, then the right one after the environment asks again
    return "#### 72" if conversation.count("<|im_start|>assistant") > 1 else "I think #### 70"


def test_skyrl_gym_multi_turn_gsm8k(tok):
    pytest.importorskip("skyrl_gym")
    row = {
        "prompt": [
            {"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. Total?"}
        ],
        "env_class": "gsm8k_multi_turn",
        "reward_spec": {"method": "rule", "ground_truth": "72"},
        "extra_info": {"max_turns": 3},
    }
    traj = run_trajectories(
        [row], lambda r: SkyRLEnvironment(), scripted(tok, gsm8k_policy), tok, multi_turn_settings()
    )[0]
    assert traj.num_assistant_turns == 2 and traj.finish_reason == "stop"
    assert traj.messages[2]["role"] == "user" and "#### ANSWER" in traj.messages[2]["content"]
    assert (
        traj.turn_rewards[1] == 1.0 and 0.0 < traj.turn_rewards[0] < 1.0
    )  # format credit for a wrong answer
    assert traj.metrics == {"steps": 2.0, "tool_calls": 0.0}  # gsm8k_multi_turn has no tools
    assert re.search(r"#### 72", traj.messages[-1]["content"])


def test_skyrl_unknown_env_class_is_a_config_error(tok):
    pytest.importorskip("skyrl_gym")
    with pytest.raises(ConfigError, match="env_class='nope'"):
        SkyRLEnvironment().reset({"prompt": [{"role": "user", "content": "x"}], "env_class": "nope"})


class SlowWriter:
    def write(self, value: int) -> str:
        """Store a value, slowly.

        Args:
            value: the value.
        """
        time.sleep(0.05)
        self.value = value
        return "ok"

    async def read(self) -> str:
        """Read the value."""
        return str(getattr(self, "value", None))


def test_trl_style_calls_of_one_turn_run_in_order():
    """The methods share the object's state: a read written after a slow write sees the write."""
    env = TRLStyleEnvironment(SlowWriter())
    text = tool_call_text("write", {"value": 5}) + tool_call_text("read", {})
    result = asyncio.run(env.step(text))
    assert [m["content"] for m in result.messages] == ["ok", "5"]
