"""environment_factory(cfg): built-ins, Environment subclasses, TRL-style classes and SkyRL environments from
`env.path`, made with `env.kwargs`, with the tool config's tools beside them; run through the real driver."""

import textwrap

import pytest

from posttrain.agents.adapters import SkyRLEnvironment, TRLStyleEnvironment, WithTools
from posttrain.agents.build import builtin_environments, environment_factory
from posttrain.agents.builtin_envs import GuessNumberEnv
from posttrain.agents.driver import run_trajectories
from posttrain.agents.env import ToolEnvironment
from posttrain.agents.hermes import tool_call_text
from posttrain.agents.tool_config import load_tool_config
from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.config.schema.names import TASK_ENVIRONMENTS
from posttrain.data.tasks import TASKS
from tests.helpers import multi_turn_settings, scripted

ADD = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b
'''

ENVS = '''
from posttrain.agents.env import Environment, StepResult


class Answer(Environment):
    def __init__(self, expected: str = "42"):
        self.expected = expected

    def step(self, text):
        return StepResult(reward=float(self.expected in text), done=True)


class Counter:
    def __init__(self, scale: int = 1):
        self.scale = scale

    def reset(self, start: int = 0, **row):
        self.value = start
        return f"The counter starts at {start}."

    def increment(self, by: int = 1) -> str:
        """Add to the counter.

        Args:
            by: how much to add.
        """
        self.value += by * self.scale
        return str(self.value)

    def get_reward(self) -> float:
        return float(self.value)
'''


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tools.py").write_text(ADD)
    (tmp_path / "envs.py").write_text(ENVS)
    (tmp_path / "tools.yaml").write_text("tools:\n  - path: tools.py:add\n")
    return tmp_path


def config(*overrides):
    return build_config(overrides=["rollout.multi_turn.enable=true", *overrides])


def test_builtin_environment_made_with_kwargs():
    env = environment_factory(
        config("env.path=guess_number", "env.kwargs.high=10", "env.kwargs.max_turns=3")
    )({})
    assert isinstance(env, GuessNumberEnv) and (env.low, env.high, env.max_turns) == (1, 10, 3)


def test_no_env_path_makes_a_tool_environment(files):
    env = environment_factory(config("rollout.multi_turn.tool_config_path=tools.yaml"))({})
    assert isinstance(env, ToolEnvironment) and [s["function"]["name"] for s in env.tool_schemas()] == ["add"]


def test_environment_subclass_with_the_tool_config(files, tok):
    cfg = config(
        "env.path=envs.py:Answer",
        "env.kwargs.expected=sum is 7",
        "rollout.multi_turn.tool_config_path=tools.yaml",
    )
    make_env = environment_factory(cfg)
    assert isinstance(make_env({}), WithTools)

    def policy(
        conversation,
    ):  # a call to the config's tool is answered by it; the answer goes to the environment
        return (
            "The sum is 7." if "<tool_response>" in conversation else tool_call_text("add", {"a": 3, "b": 4})
        )

    traj = run_trajectories(
        [{"prompt": "3 + 4?"}], make_env, scripted(tok, policy), tok, multi_turn_settings()
    )[0]
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert traj.messages[2]["content"] == "7" and traj.reward == 1.0
    assert traj.metrics["tool_calls/add"] == 1.0


def test_trl_style_class_gets_the_tool_config_tools_too(files, tok):
    cfg = config(
        "env.path=envs.py:Counter", "env.kwargs.scale=2", "rollout.multi_turn.tool_config_path=tools.yaml"
    )
    make_env = environment_factory(cfg)
    env = make_env({})
    assert isinstance(env, TRLStyleEnvironment)
    assert sorted(s["function"]["name"] for s in env.tool_schemas()) == ["add", "increment"]

    def policy(conversation):
        if "<tool_response>" in conversation:
            return "Done."
        return tool_call_text("increment", {"by": 3}) + tool_call_text("add", {"a": 1, "b": 1})

    rows = [{"prompt": "Count.", "start": 1}]
    traj = run_trajectories(rows, make_env, scripted(tok, policy), tok, multi_turn_settings())[0]
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["7", "2"]
    assert traj.reward == 7.0  # get_reward(): the counter, scaled by env.kwargs.scale


def test_skyrl_environment_by_name_or_row():
    pytest.importorskip("skyrl_gym")
    env = environment_factory(config("env.path=skyrl:gsm8k_multi_turn", "env.kwargs.max_turns=3"))({})
    assert isinstance(env, SkyRLEnvironment) and env.env_class == "gsm8k_multi_turn"
    assert env.env_config == {"max_turns": 3}
    assert environment_factory(config("env.path=skyrl"))({}).env_class is None  # the row's env_class decides
    assert isinstance(environment_factory(config())({"env_class": "gsm8k"}), SkyRLEnvironment)
    assert isinstance(environment_factory(config())({"prompt": "hi"}), ToolEnvironment)


def test_env_kwargs_must_fit_the_constructor():
    with pytest.raises(ConfigError, match=r"env.kwargs.hgh=5 does not fit .*GuessNumberEnv.*\['low', 'high'"):
        environment_factory(config("env.path=guess_number", "env.kwargs.hgh=5"))


def test_a_class_that_is_neither_kind_is_refused(files):
    (files / "odd.py").write_text("class Odd:\n    def step(self, text):\n        return None\n")
    with pytest.raises(ConfigError, match="neither a posttrain Environment subclass nor a TRL-style class"):
        environment_factory(config("env.path=odd.py:Odd"))


def test_skyrl_with_a_tool_config_is_refused(files):
    with pytest.raises(ConfigError, match="SkyRL environments run their own tools"):
        environment_factory(config("env.path=skyrl:gsm8k", "rollout.multi_turn.tool_config_path=tools.yaml"))


def test_verl_tool_yaml(files, monkeypatch):
    monkeypatch.syspath_prepend(str(files))
    (files / "verl_tools.yaml").write_text(
        textwrap.dedent(
            """\
            tools:
              - class_name: tools.add
                config: {type: native}
                tool_schema:
                  type: function
                  function:
                    name: add
                    description: Add two integers.
                    parameters:
                      type: object
                      properties: {a: {type: integer}, b: {type: integer}}
                      required: [a, b]
            """
        )
    )
    tools = load_tool_config(files / "verl_tools.yaml")
    assert tools["add"].schema["function"]["description"] == "Add two integers."
    (files / "cls.py").write_text("class Tool:\n    pass\n")
    (files / "cls.yaml").write_text("tools:\n  - class_name: cls.Tool\n")
    with pytest.raises(ConfigError, match="is a class"):
        load_tool_config(files / "cls.yaml")
    (files / "cfg.yaml").write_text("tools:\n  - class_name: tools.add\n    config: {type: mcp}\n")
    with pytest.raises(ConfigError, match="config=.*is not supported"):
        load_tool_config(files / "cfg.yaml")


def test_task_environments_agree_with_the_tasks():
    """config/ cannot import the task registry: its copy of each task's environment is checked here."""
    for task in TASKS.values():
        if task.environment:
            assert TASK_ENVIRONMENTS.get(task.name) == task.environment
    for name, environment in TASK_ENVIRONMENTS.items():
        if name in TASKS:
            assert TASKS[name].environment == environment
            assert environment in builtin_environments()
