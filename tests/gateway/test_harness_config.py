"""harness.* settings that cannot work stop the run at load (or preflight) with one message naming the key, the
value, the rule and a fix."""

import sys

import pytest
from rich.console import Console

from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.gateway.harness import check_harness
from posttrain.planning.multi_turn import multi_turn_plan, multi_turn_tree
from posttrain.planning.preflight import preflight


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "h.py").write_text("def agent(row, base_url, api_key):\n    return None\n")
    return tmp_path


def test_a_harness_loads_with_defaults(here):
    cfg = build_config(overrides=["harness.path=h.py:agent"])
    check_harness(cfg)
    assert cfg.harness.on_prefix_break == "last" and cfg.harness.host == "127.0.0.1" and cfg.harness.port == 0


@pytest.mark.parametrize("task", ["calculator", "guess_number"])
def test_a_multi_turn_task_gives_a_harness_its_rows_and_not_its_environment(here, task):
    cfg = build_config(overrides=["harness.path=h.py:agent", f"data.task={task}"])
    assert cfg.env.path == "" and not cfg.rollout.multi_turn.enable


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            [f"harness.command={sys.executable} a.py"],
            "harness.path='h.py:agent' and harness.command=.* both set",
        ),
        (
            ["env.path=guess_number"],
            "harness.path='h.py:agent' with env.path='guess_number': .* drop env.path",
        ),
        (["rollout.multi_turn.enable=true"], "with rollout.multi_turn.enable=true: a harness is its own"),
        (["env.kwargs.level=2"], r"with env.kwargs=\{'level': 2\}: a harness has no posttrain environment"),
        (
            ["rollout.multi_turn.tool_config_path=t.yaml"],
            "sends its own tools .* drop rollout.multi_turn.tool_",
        ),
        (["harness.on_prefix_break=split"], "harness.on_prefix_break"),
    ],
)
def test_refused_at_load(here, extra, message):
    with pytest.raises(ConfigError, match=message):
        build_config(overrides=["harness.path=h.py:agent", *extra])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["harness.path=h.py:nope"], "harness.path='h.py:nope': .* defines no 'nope'"),
        (["harness.path=missing.py:agent"], "harness.path='missing.py:agent': file 'missing.py' not found"),
        (
            ["harness.command=not-a-program-q"],
            "harness.command='not-a-program-q': program 'not-a-program-q' not",
        ),
        (
            ["harness.path=h.py:agent", "algorithm.adv_estimator=remax"],
            "adv_estimator=remax with harness.path",
        ),
        (
            ["harness.path=h.py:agent", "async_training.partial_rollout=true"],
            "partial_rollout=true with harness",
        ),
        (
            [
                "harness.path=h.py:agent",
                "data.max_response_length=64",
                "rollout.multi_turn.max_tokens_per_turn=65",
            ],
            "max_tokens_per_turn=65 is more than data.max_response_length=64",
        ),
    ],
)
def test_refused_before_any_model_loads(here, extra, message):
    cfg = build_config(overrides=extra)
    with pytest.raises(ConfigError, match=message):
        check_harness(cfg)


@pytest.mark.parametrize("command", ["train", "explain", "eval"])
def test_preflight_checks_the_harness(here, command):
    cfg = build_config(overrides=["harness.path=h.py:nope"])
    with pytest.raises(ConfigError, match="harness.path='h.py:nope': .* defines no 'nope'"):
        preflight(cfg, command, check_model=False)


def test_explain_shows_the_harness_plan(here):
    cfg = build_config(overrides=["harness.path=h.py:agent", "harness.max_concurrent=4"])
    plan = multi_turn_plan(cfg)
    assert plan["harness"] == "harness.path='h.py:agent'" and plan["max_concurrent"] == 4
    console = Console(width=200, record=True)
    console.print(multi_turn_tree(cfg))
    text = console.export_text()
    assert "harness rollouts (harness.path='h.py:agent')" in text and "harness.on_prefix_break=last" in text
