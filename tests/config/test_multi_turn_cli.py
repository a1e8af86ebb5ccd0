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


def test_explain_counts_the_tool_block_in_the_prompt_and_warns_of_a_tool_limit_over_the_budget(here, capsys):
    """A tool config's schemas are rendered into every prompt: the plan said "sequences <= 224 tokens (64 prompt
    + 160 response)" for a 471-token prompt, and kept quiet about a tool limit (256) over the budget (160)."""
    from posttrain.agents.render import Renderer
    from posttrain.agents.tool_config import load_tool_config
    from posttrain.models.tiny import build_tiny_tokenizer

    args = [
        ON,
        "rollout.multi_turn.tool_config_path=tools.yaml",
        "data.max_prompt_length=64",
        "data.max_response_length=160",
        "rollout.multi_turn.max_tool_response_length=256",
    ]
    assert cli.main(["explain", "--json", *args]) == 0
    data = json.loads(capsys.readouterr().out)["multi_turn"]
    tok, probe = build_tiny_tokenizer(), [{"role": "user", "content": "hi"}]
    schemas = load_tool_config(here / "tools.yaml").schemas()
    block = len(Renderer(tok, tools=schemas).prompt_ids(probe)) - len(Renderer(tok).prompt_ids(probe))
    assert block > 50 and data["tool_block_tokens"] == block
    assert data["max_sequence_tokens"] == 64 + block + 160
    assert len(data["warnings"]) == 1 and "max_tool_response_length=256 exceeds" in data["warnings"][0]
    assert cli.main(["explain", *args]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())  # the tree's guides cut wrapped lines
    assert "(the multi-turn plan below counts a tool schema block on top)" in out
    assert f"the tool schema block adds {block} tokens to every prompt" in out
    assert (
        f"sequences reach {64 + block + 160} tokens (64 prompt + {block} tool schemas + 160 response)" in out
    )
    assert "warning: rollout.multi_turn.max_tool_response_length=256 exceeds" in out
    assert cli.main(["explain", "--json", *args[:-1], "rollout.multi_turn.max_tool_response_length=100"]) == 0
    assert json.loads(capsys.readouterr().out)["multi_turn"]["warnings"] == []


def test_explain_without_the_model_says_the_tool_block_is_not_counted(here, capsys):
    """`explain --model-config` plans without the model directory: no tokenizer to count the block with."""
    from pathlib import Path

    config = Path(__file__).parents[2] / "examples" / "model_configs" / "qwen2.5-7b"
    args = [ON, "rollout.multi_turn.tool_config_path=tools.yaml", f"model.path={here / 'absent'}"]
    assert cli.main(["explain", "--json", *args, "--model-config", str(config)]) == 0
    data = json.loads(capsys.readouterr().out)["multi_turn"]
    assert data["tool_block_tokens"] is None and data["max_sequence_tokens"] is None
