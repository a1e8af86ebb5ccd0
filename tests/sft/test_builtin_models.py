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


def test_warm_start_cache_key_follows_the_cpu_kernels_and_the_leaked_settings():
    """A warm start built with other CPU kernels (ATEN_CPU_CAPABILITY, read once at torch's start: a fresh
    process) or with a user's sft / model setting that reaches its training is another model, built again."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from posttrain.models.model_path import cache_key

    cfg = build_config(overrides=[])
    here = builtin.warm_start_key(cfg)
    assert here["kernels"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert here["kernels"]["torch"] == torch.__version__
    probe = (
        "import json\nfrom posttrain.config.load import build_config\nfrom posttrain.sft.builtin import "
        "warm_start_key\nprint(json.dumps(warm_start_key(build_config(overrides=[]))))"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    default_kernels = json.loads(done.stdout.strip().splitlines()[-1])
    assert default_kernels["kernels"]["cpu_capability"] == "DEFAULT"
    if here["kernels"]["cpu_capability"] != "DEFAULT":  # this CPU has vector kernels: the keys must differ
        assert cache_key(default_kernels) != cache_key(here)
    # The user's sft optimiser settings reach the warm start's training; its data files never do.
    assert builtin.warm_start_key(build_config(overrides=["sft.optim.eps=1e-6"])) != here
    assert builtin.warm_start_key(build_config(overrides=["model.use_remove_padding=true"])) != here
    assert builtin.warm_start_key(build_config(overrides=["sft.output_dir=elsewhere"])) == here
