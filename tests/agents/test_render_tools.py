"""`rollout.multi_turn.render_tools`: the tool schemas in the prompt or not, for any tool config or environment,
with the calls parsed and run either way; the built-in calculator environment leaves them out by default."""

import pytest

from posttrain.agents.build import environment_factory
from posttrain.agents.driver import MultiTurnSettings, run_trajectories
from posttrain.agents.hermes import tool_call_text
from posttrain.agents.render import Renderer
from posttrain.config.errors import ConfigError
from posttrain.config.load import apply_values, build_config
from tests.helpers import scripted

TOOLS = '''
def lookup(word: str) -> str:
    """The word's colour.

    Args:
        word: one word.
    """
    return {"sky": "blue", "grass": "green"}.get(word, "unknown")
'''
PROMPT = "What colour is the sky?"


@pytest.fixture
def tool_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tools.py").write_text(TOOLS)
    (tmp_path / "tools.yaml").write_text("tools:\n  - path: tools.py:lookup\n")
    return "rollout.multi_turn.tool_config_path=tools.yaml"


def policy(conversation: str) -> str:
    """Calls the tool once, then answers with its result."""
    if "<tool_response>" not in conversation:
        return tool_call_text("lookup", {"word": "sky"})
    return conversation.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0]


def play(tok, *overrides):
    cfg = build_config(overrides=["rollout.multi_turn.enable=true", *overrides])
    settings = MultiTurnSettings(cfg.rollout.multi_turn, max_response_length=256)
    rows = [{"prompt": PROMPT}]
    return run_trajectories(rows, environment_factory(cfg), scripted(tok, policy), tok, settings)[0]


def test_render_tools_false_gives_the_no_tools_prompt_and_still_runs_the_calls(tok, tool_config):
    shown = play(tok, tool_config)
    hidden = play(tok, tool_config, "rollout.multi_turn.render_tools=false")
    user = [{"role": "user", "content": PROMPT}]
    assert hidden.prompt_ids == Renderer(tok).prompt_ids(user)  # exactly the prompt of a run without tools
    assert shown.prompt_ids == Renderer(tok, tools=shown.tools).prompt_ids(user)
    assert len(shown.prompt_ids) > len(hidden.prompt_ids) + 50 and hidden.tools is None
    for traj in (shown, hidden):  # the call is parsed and run either way, and the answer uses its result
        assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
        assert traj.messages[2]["content"] == "blue" and traj.messages[3]["content"] == "blue"
        assert traj.metrics["tool_calls/lookup"] == 1.0
    assert hidden.response_ids == shown.response_ids  # the same turns after a different prompt


def test_the_calculator_environment_hides_its_schemas_unless_set():
    assert not build_config(overrides=["data.task=calculator"]).rollout.multi_turn.render_tools
    assert not build_config(
        overrides=["rollout.multi_turn.enable=true", "env.path=calculator"]
    ).rollout.multi_turn.render_tools
    explicit = build_config(overrides=["data.task=calculator", "rollout.multi_turn.render_tools=true"])
    assert explicit.rollout.multi_turn.render_tools
    assert apply_values(explicit, {"trainer.seed": 3}).rollout.multi_turn.render_tools  # resolved once, kept
    assert build_config(overrides=["data.task=python_arithmetic"]).rollout.multi_turn.render_tools


def test_the_old_env_kwarg_names_the_setting():
    cfg = build_config(overrides=["data.task=calculator", "env.kwargs.show_schemas=true"])
    with pytest.raises(ConfigError, match="rollout.multi_turn.render_tools=false"):
        environment_factory(cfg)
