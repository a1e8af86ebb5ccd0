"""Per-tool call counts for tools from any source: an environment that keeps its schemas out of the prompt, and
one's own skyrl-gym environment (its tools run through skyrl-gym's tool groups), registered by `env.path`."""

import pytest

from posttrain.agents.builtin_envs import CalculatorEnv
from posttrain.agents.driver import run_trajectories
from posttrain.agents.trajectory import Trajectory
from posttrain.config.load import build_config
from posttrain.rl.collect.multi_turn import build_agent_loop, logged_tool_names
from tests.helpers import multi_turn_settings, scripted

OWN_SKYRL_ENV = '''
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.tools.core import ToolGroup, tool


class Codebook(ToolGroup):
    def __init__(self):
        super().__init__(name="Codebook")

    @tool
    def lookup(self, word):
        return {"apple": "K7"}.get(word, "unknown")


class SecretCodes(BaseTextEnv):
    """The model calls lookup(word) with <lookup>word</lookup>; the reward is 1 for the word's code."""

    def __init__(self, env_config=None, extras={}):
        super().__init__()
        self.answer = extras["reward_spec"]["ground_truth"]
        self.init_tool_groups([Codebook()])

    def step(self, action):
        self.turns += 1
        if "<lookup>" in action:
            word = action.split("<lookup>")[1].split("</lookup>")[0]
            code = self._execute_tool("Codebook", "lookup", [word])
            return BaseTextEnvStepOutput(
                observations=[{"role": "user", "content": code}], reward=0.0, done=False, metadata={}
            )
        return BaseTextEnvStepOutput(observations=[], reward=float(self.answer in action), done=True, metadata={})
'''


def test_tools_whose_schemas_stay_out_of_the_prompt_are_still_named(tok):
    assert CalculatorEnv().tool_names() == ["calculator"]
    cfg = build_config(overrides=["data.task=calculator"])
    assert cfg.rollout.multi_turn.render_tools is False  # the calculator's default: no schema block
    loop = build_agent_loop(cfg, tok)
    assert loop.tool_names == ("calculator",)  # so tool_call_counts/calculator is logged


def test_own_skyrl_gym_class_by_env_path_counts_its_tool_calls(tok, tmp_path, monkeypatch):
    pytest.importorskip("skyrl_gym")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "codes.py").write_text(OWN_SKYRL_ENV)
    cfg = build_config(overrides=["rollout.multi_turn.enable=true", "env.path=codes.py:SecretCodes"])
    loop = build_agent_loop(cfg, tok)
    row = {
        "prompt": [{"role": "user", "content": "The code of apple?"}],
        "reward_spec": {"method": "rule", "ground_truth": "K7"},
    }

    def policy(conversation):
        return "The code is K7" if "K7" in conversation else "<lookup>apple</lookup>"

    [traj] = run_trajectories([row], loop.make_env, scripted(tok, policy), tok, multi_turn_settings())
    assert traj.reward == 1.0 and traj.messages[2]["content"] == "K7"
    assert traj.metrics["tool_calls"] == 1.0 and traj.metrics["tool_calls/lookup"] == 1.0
    # the SkyRL tool is known only once a row made the environment: the step logs it because it was called
    assert logged_tool_names(loop.tool_names, [traj]) == ("lookup",)


def test_logged_tool_names_keep_the_known_ones_first():
    called = Trajectory(prompt_ids=[0], messages=[], metrics={"tool_calls/b": 1.0, "tool_calls/a": 2.0})
    gather = lambda names: [names, ["z"]]  # noqa: E731  (another rank called z)
    assert logged_tool_names(("a",), [called], gather) == ("a", "b", "z")
