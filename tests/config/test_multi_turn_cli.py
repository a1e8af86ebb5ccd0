"""Multi-turn settings that cannot work stop `posttrain explain` / `train` with exit code 2 and one message
naming the key, the value, the rule and a fix, before any model loads; explain prints the multi-turn plan."""

import json

import pytest

from posttrain import cli
from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.planning.multi_turn import multi_turn_plan
from posttrain.rl import build

ON = "rollout.multi_turn.enable=true"
TOOL = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b
'''


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tools.py").write_text(TOOL)
    (tmp_path / "tools.yaml").write_text("tools:\n  - path: tools.py:add\n")
    (tmp_path / "envs.py").write_text(
        "from posttrain.agents.env import Environment\n\n\n"
        "class Picky(Environment):\n"
        "    def __init__(self, level: int = 1):\n"
        "        if level < 0:\n"
        "            raise ValueError('level must be >= 0')\n"
    )

    def fail(*args, **kwargs):
        raise AssertionError("a model was loaded before the pre-flight checks failed")

    monkeypatch.setattr(build, "load_causal_lm", fail)
    return tmp_path


def refused(capsys, command, *args):
    assert cli.main([command, *args]) == 2
    return capsys.readouterr().err


CASES = [
    (
        [ON, "rollout.multi_turn.tool_config_path=missing.yaml"],
        ["rollout.multi_turn.tool_config_path", "'missing.yaml' not found"],
    ),
    (
        [ON, "rollout.multi_turn.tool_config_path=bad.yaml"],
        ["rollout.multi_turn.tool_config_path='bad.yaml'", "cannot be read", "fix the file's syntax"],
    ),
    (
        [ON, "rollout.multi_turn.tool_config_path=nofn.yaml"],
        ["rollout.multi_turn.tool_config_path='nofn.yaml'", "defines no 'subtract'", "['add']"],
    ),
    (
        [ON, "rollout.multi_turn.tool_config_path=schema.yaml"],
        ["rollout.multi_turn.tool_config_path='schema.yaml'", "tools[0] (tools.py:add)", "'c'"],
    ),
    ([ON, "env.path=nowhere.py:Env"], ["env.path='nowhere.py:Env'", "file 'nowhere.py' not found"]),
    ([ON, "env.path=envs.py:Nope"], ["env.path='envs.py:Nope'", "defines no 'Nope'", "Picky"]),
    ([ON, "env.path=nonsense"], ["env.path='nonsense' must be a built-in environment", "guess_number"]),
    ([ON, "env.path=envs.py:Picky", "env.kwargs.levl=2"], ["env.kwargs.levl=2 does not fit", "['level']"]),
    (
        [ON, "env.path=envs.py:Picky", "env.kwargs.level=-1"],
        ["env.kwargs={'level': -1}", "level must be >= 0", "fix env.kwargs"],
    ),
    (
        ["env.path=guess_number"],
        ["env.path='guess_number'", "rollout.multi_turn.enable=false", "set rollout"],
    ),
    (
        ["rollout.multi_turn.tool_config_path=tools.yaml"],
        ["rollout.multi_turn.tool_config_path='tools.yaml'", "rollout.multi_turn.enable=false"],
    ),
    ([ON, "env.kwargs.x=1"], ["env.kwargs={'x': 1} is set but env.path is empty"]),
    (
        [ON, "algorithm.adv_estimator=remax", "rollout.n=1"],
        ["algorithm.adv_estimator=remax", "greedy", "use grpo"],
    ),
    (
        [ON, "async_training.enable=true", "async_training.partial_rollout=true"],
        ["async_training.partial_rollout=true", "mask", "set async_training.partial_rollout=false"],
    ),
    (
        [ON, "rollout.multi_turn.max_tokens_per_turn=16", "data.max_response_length=8"],
        ["rollout.multi_turn.max_tokens_per_turn=16", "data.max_response_length=8", "<= 8"],
    ),
]


@pytest.mark.parametrize("args,words", CASES, ids=[str(i) for i in range(len(CASES))])
def test_explain_refuses(args, words, here, capsys):
    (here / "bad.yaml").write_text("tools: [\n")
    (here / "nofn.yaml").write_text("tools:\n  - path: tools.py:subtract\n")
    (here / "schema.yaml").write_text(
        "tools:\n  - path: tools.py:add\n    schema:\n      type: function\n      function:\n        name: add\n"
        "        parameters: {type: object, properties: {a: {type: integer}, c: {type: integer}}}\n"
    )
    err = refused(capsys, "explain", *args)
    assert err.count("\n") == 1, err
    for word in words:
        assert word in err, err


def test_train_refuses_before_loading(here, capsys):
    err = refused(capsys, "train", ON, "env.path=envs.py:Picky", "env.kwargs.levl=2")
    assert "env.kwargs.levl=2 does not fit" in err


def test_multi_turn_task_cannot_be_turned_off():
    cfg = build_config(overrides=["data.task=guess_number"])
    assert cfg.rollout.multi_turn.enable and cfg.env.path == "guess_number"
    assert build_config(overrides=["data.task=calculator", "env.path=x.py:Y"]).env.path == "x.py:Y"
    with pytest.raises(ConfigError, match="rollout.multi_turn.enable=false, but data.task=guess_number"):
        build_config(overrides=["data.task=guess_number", "rollout.multi_turn.enable=false"])


def test_the_plan_says_a_task_implies_multi_turn():
    plan = multi_turn_plan(build_config(overrides=["data.task=guess_number", "env.kwargs.high=9"]))
    assert plan["implied_by_task"] == "guess_number"
    assert plan["environment"] == "posttrain.agents.builtin_envs.GuessNumberEnv"
    assert plan["environment_kwargs"] == {"low": 1, "high": 9, "max_turns": 7}


def test_explain_prints_the_multi_turn_plan(here, capsys):
    args = [
        ON,
        "env.path=guess_number",
        "env.kwargs.high=50",
        "rollout.multi_turn.tool_config_path=tools.yaml",
    ]
    assert cli.main(["explain", *args, "rollout.multi_turn.max_tokens_per_turn=6"]) == 0
    out = capsys.readouterr().out
    plan = out[out.index("multi-turn rollouts") :]
    for words in [
        "at most 5 assistant turns",
        "5 environment replies",
        "data.max_response_length=8 tokens",
        "at most 6 tokens (rollout.multi_turn.max_tokens_per_turn)",
        "masked out of",
        "GuessNumberEnv(low=1, high=50, max_turns=7)",
        '"name": "add"',
        '"required": ["a", "b"]',
    ]:
        assert words in " ".join(plan.split()), words
    assert cli.main(["explain", "--json", *args]) == 0
    data = json.loads(capsys.readouterr().out)["multi_turn"]
    assert data["environment_kwargs"] == {"low": 1, "high": 50, "max_turns": 7}
    assert [t["function"]["name"] for t in data["tools"]] == ["add"]
    assert cli.main(["explain", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["multi_turn"] is None


def test_explain_names_the_tools_an_environment_keeps_out_of_the_prompt(capsys):
    """The calculator task leaves its tool's schema out of the prompt (rollout.multi_turn.render_tools=false by
    default there) and still answers `calculator` calls."""
    assert cli.main(["explain", "data.task=calculator"]) == 0
    plan = " ".join(capsys.readouterr().out.split())
    assert "tools the environment answers without listing them in the prompt: calculator" in plan
    assert "tools: none" not in plan
    assert cli.main(["explain", "--json", "data.task=calculator"]) == 0
    data = json.loads(capsys.readouterr().out)["multi_turn"]
    assert data["tools"] == [] and data["tools_not_in_prompt"] == ["calculator"]
