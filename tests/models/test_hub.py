"""model.path as a Hub id, resolved from the local Hugging Face cache when offline (nothing downloads)."""

import shutil

import pytest

from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.models.hf import load_causal_lm
from posttrain.models.model_path import resolve_model_path
from posttrain.planning.preflight import check_model_path


@pytest.fixture
def offline_cache(tmp_path, monkeypatch, tiny_model_dir):
    """A cache holding 'tiny-org/tiny-model' in the layout huggingface_hub writes."""
    repo = tmp_path / "hub" / "models--tiny-org--tiny-model"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


def test_hub_id_resolves_to_the_cached_snapshot_offline(offline_cache):
    cfg = build_config(overrides=["model.path=tiny-org/tiny-model"])
    check_model_path(cfg)
    path = resolve_model_path(cfg, warm_start=None)
    assert path == offline_cache
    assert load_causal_lm(path).config.model_type == "qwen2"


def test_uncached_hub_id_offline_is_a_config_error(offline_cache):
    cfg = build_config(overrides=["model.path=tiny-org/not-cached"])
    with pytest.raises(
        ConfigError, match=r"'tiny-org/not-cached' is a Hub id that is not in the local .*HF_HUB_OFFLINE"
    ):
        check_model_path(cfg)
