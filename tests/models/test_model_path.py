"""model.path resolved to a directory: builtin:tiny (the arithmetic demo, warm-started) is refused on the user's
own data and built by the warm start the caller hands in, builtin:base is the untrained tiny model, and leftover
build folders of dead processes are removed."""

import os
import subprocess
import sys

import pytest

from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.models.model_path import remove_stale_builds, resolve_model_path


def test_builtin_tiny_is_refused_on_user_data_and_points_to_base(tmp_path):
    cfg = build_config(
        overrides=[f"data.train_files=[{tmp_path / 't.jsonl'}]", "reward.function=exact_match"]
    )
    with pytest.raises(
        ConfigError, match=r"builtin:tiny is the arithmetic demo's model.*data.train_files.*builtin:base"
    ):
        resolve_model_path(cfg, warm_start=None)


def test_builtin_base_is_the_untrained_tiny_model():
    cfg = build_config(overrides=["model.path=builtin:base", "trainer.seed=3"])
    path = resolve_model_path(cfg, warm_start=None)
    assert (path / "config.json").exists() and "tiny-base" in path.name and "seed3" in path.name
    assert not (path / "posttrain_builtin.json").exists()  # no warm start recorded: untrained


def test_builtin_tiny_is_built_by_the_warm_start_handed_in(tmp_path):
    """models/ sits below sft/: the SFT warm start comes in as a function, called with (cfg, quiet)."""
    cfg = build_config(overrides=["model.path=builtin:tiny"])
    calls = []

    def warm_start(config, quiet):
        calls.append((config, quiet))
        return tmp_path

    assert resolve_model_path(cfg, quiet=True, warm_start=warm_start) == tmp_path
    assert calls == [(cfg, True)]
    with pytest.raises(ValueError, match="builtin:tiny but was given no warm_start"):
        resolve_model_path(cfg, warm_start=None)  # a caller's bug, not the user's: no ConfigError


def test_stale_build_folders_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f".tmp-tiny-base-v2-seed1-{dead.stdout.strip()}"
    live = tmp_path / f".tmp-tiny-base-v2-seed1-{os.getpid()}"
    stale.mkdir()
    live.mkdir()
    assert remove_stale_builds(tmp_path) == [stale]
    assert live.exists() and not stale.exists()
