"""The built-in models: builtin:tiny (the arithmetic demo, warm-started) is refused on the user's own data,
builtin:base is the untrained tiny model, the warm-start cache is keyed only by what shapes the model, and
leftover build folders of dead processes are removed."""

import os
import subprocess
import sys

import pytest
import torch

from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.sft import builtin
from posttrain.sft.builtin import builtin_model_dir, remove_stale_builds, resolve_model_path


def test_builtin_tiny_is_refused_on_user_data_and_points_to_base(tmp_path):
    cfg = build_config(
        overrides=[f"data.train_files=[{tmp_path / 't.jsonl'}]", "reward.function=exact_match"]
    )
    with pytest.raises(
        ConfigError, match=r"builtin:tiny is the arithmetic demo's model.*data.train_files.*builtin:base"
    ):
        resolve_model_path(cfg)


def test_builtin_base_is_the_untrained_tiny_model():
    cfg = build_config(overrides=["model.path=builtin:base", "trainer.seed=3"])
    path = resolve_model_path(cfg)
    assert (path / "config.json").exists() and "tiny-base" in path.name and "seed3" in path.name
    assert not (path / "posttrain_builtin.json").exists()  # no warm start recorded: untrained


def test_warm_start_cache_key_ignores_what_does_not_shape_the_model(monkeypatch, tmp_path):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))  # empty: other tests may have built one
    builds = []
    monkeypatch.setattr(
        builtin, "run_sft", lambda *a, **k: builds.append(1)
    )  # the SFT itself is not under test
    first = builtin_model_dir(build_config(overrides=["data.val_batch_size=64"]), quiet=True)
    again = builtin_model_dir(build_config(overrides=["data.val_batch_size=16", "rollout.n=4"]), quiet=True)
    other_seed = builtin_model_dir(build_config(overrides=["trainer.seed=2"]), quiet=True)
    assert first == again and other_seed != first
    assert len(builds) == 2  # the first config and the other seed; the batch-size change reused the cache
    threads = torch.get_num_threads()
    try:  # float rounding follows the thread count: another thread count is another warm start
        torch.set_num_threads(threads + 1)
        assert builtin_model_dir(build_config(overrides=[]), quiet=True) != first
    finally:
        torch.set_num_threads(threads)


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
