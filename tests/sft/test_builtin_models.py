"""The built-in model's SFT warm start: its cache is keyed only by what shapes the model, and the commands build
builtin:tiny through it (the model-path tests are in tests/models/test_model_path.py)."""

import pytest
import torch

from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.models.model_path import resolve_model_path
from posttrain.sft import builtin
from posttrain.sft.builtin import builtin_model_dir


def test_builtin_tiny_resolves_to_the_cached_warm_start(monkeypatch, tmp_path):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(builtin, "run_sft", lambda *a, **k: None)  # the SFT itself is not under test
    cfg = build_config(overrides=["model.path=builtin:tiny"])
    path = resolve_model_path(cfg, quiet=True, warm_start=builtin_model_dir)
    assert path == builtin_model_dir(cfg, quiet=True) and path.parent == tmp_path / "cache"
    assert (
        path / "posttrain_builtin.json"
    ).exists()  # the warm start's recipe is recorded beside the weights
    with pytest.raises(ConfigError, match="builtin:tiny is the arithmetic demo's model"):
        on_user_data = build_config(overrides=[f"sft.train_files=[{tmp_path / 't.jsonl'}]"])
        resolve_model_path(on_user_data, warm_start=builtin_model_dir)


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
