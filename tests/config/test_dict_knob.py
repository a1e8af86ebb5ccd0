"""`env.kwargs` is a dict knob: entries set from YAML or the command line (values read as YAML scalars)."""

import pytest

from posttrain.config.errors import ConfigError
from posttrain.config.load import all_keys, build_config, diff_from_defaults, is_key
from posttrain.planning.keys import key_lines


def test_yaml_and_command_line_entries_merge(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text('env:\n  kwargs:\n    max_turns: 6\n    label: "7"\n    nested: {a: 1}\n')
    cfg = build_config([path], ["env.kwargs.max_turns=8", "env.kwargs.low=-3", "env.kwargs.word=abc"])
    assert cfg.env.kwargs == {"max_turns": 8, "label": "7", "nested": {"a": 1}, "low": -3, "word": "abc"}
    assert diff_from_defaults(cfg)["env.kwargs.max_turns"] == 8


def test_command_line_values_are_yaml_scalars():
    cfg = build_config(
        overrides=["env.kwargs.x=6", "env.kwargs.y=0.5", "env.kwargs.z=true", "env.kwargs.w=[1,2]"]
    )
    assert cfg.env.kwargs == {"x": 6, "y": 0.5, "z": True, "w": [1, 2]}
    assert build_config(overrides=["env.kwargs={a: 1}"]).env.kwargs == {"a": 1}
    assert build_config(overrides={"env": {"kwargs": {}}}).env.kwargs == {}


def test_defaults_are_not_shared_between_configs():
    a = build_config(overrides=["env.kwargs.x=1"])
    b = build_config()
    assert b.env.kwargs == {} and a.env.kwargs == {"x": 1}


def test_unknown_keys_stay_errors():
    with pytest.raises(ConfigError, match="unknown config key 'env.kwarg'"):
        build_config(overrides=["env.kwarg.x=1"])
    with pytest.raises(ConfigError, match="'env.path' is a value, not a section"):
        build_config(overrides=["env.path.x=1"])
    with pytest.raises(ConfigError, match="env.kwargs' expects a mapping"):
        build_config(overrides=["env.kwargs=5"])


def test_key_lists_know_the_dict_knob():
    assert "env.kwargs" in all_keys() and is_key("env.kwargs.max_turns") and not is_key("env.kwarg.x")
    assert any(line.startswith("env.kwargs (mapping NAME -> value, default {})") for line in key_lines())
