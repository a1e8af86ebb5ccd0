"""`explain --suggest` is size-aware below 0.5B, and `explain` names the model it estimated."""

import shutil

import pytest

from posttrain.cli import main
from posttrain.config.load import build_config
from posttrain.planning.advice import check_starting_point, starting_point
from posttrain.planning.shape import ModelShape, builtin_tiny_hf_config


def test_a_tiny_model_gets_the_cpu_demo_starting_point_and_a_valid_plan():
    shape = ModelShape.from_hf_config(builtin_tiny_hf_config(), name="builtin:base")
    point = starting_point(shape)
    assert point.tier.startswith("tiny") and point.overrides["actor.optim.lr"] == 2e-4
    assert check_starting_point(point, 1, lambda: build_config()) is None


def test_explain_on_a_real_model_path_says_which_model_it_estimated(tiny_model_dir, capsys):
    assert main(["explain", "--suggest", f"model.path={tiny_model_dir}"]) == 0
    out = capsys.readouterr().out
    assert f"Memory estimate for {tiny_model_dir.name} (" in out and "starting point for a tiny" in out


def test_explain_estimates_a_hub_id_from_the_local_cache(tiny_model_dir, tmp_path, monkeypatch, capsys):
    repo = tmp_path / "hub" / "models--org--small"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / "abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["explain", "model.path=org/small"]) == 0
    assert "Memory estimate for org/small (" in capsys.readouterr().out


@pytest.mark.parametrize("params, tier", [(3e6, "tiny"), (1.2e8, "sub-0.5B"), (5e8, "sub-0.5B")])
def test_tiers_below_half_a_billion(params, tier, monkeypatch):
    shape = ModelShape.from_hf_config(builtin_tiny_hf_config(), name="x")
    monkeypatch.setattr(ModelShape, "num_params", lambda self: params)
    assert starting_point(shape).tier.startswith(tier)
