"""Shared test setup: small thread pools (CI has 2 cores), a private cache, tiny model directories."""

import os
import signal

import pytest
import torch

from posttrain.config.errors import ConfigError
from posttrain.models.tiny import build_tiny_tokenizer
from posttrain.sandbox import LocalSandbox
from tests.sandbox_support import TIGHT

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    from tests.local_ray import stop_on_sigterm

    stop_on_sigterm()


def pytest_collection_modifyitems(config, items):
    """The files of multi-process or minute-long tests (markers ``dist``, ``long``) first, the rest in their usual
    order: pytest-xdist (``--dist loadfile``) hands files out in this order, so the long ones start early and the
    suite does not end with one worker finishing a long file while the other is idle."""
    first = {
        item.path for item in items if item.get_closest_marker("dist") or item.get_closest_marker("long")
    }
    items.sort(key=lambda item: item.path not in first)  # stable: the order within each group is kept


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A SIGTERM that reached the test as an exception (posttrain's handler raises Terminated, Ray's driver
    handler SystemExit(15)) stops the session after this test, its fixtures torn down, as Ctrl-C does."""
    from posttrain.utils.signals import Terminated

    report = yield
    exc = call.excinfo
    if exc is not None and (
        exc.errisinstance(Terminated) or (exc.errisinstance(SystemExit) and exc.value.code == signal.SIGTERM)
    ):
        item.session.shouldstop = "terminated (SIGTERM)"
    return report


def _tiny_model(tmp_path_factory, name: str, hidden_size: int, intermediate_size: int, seed: int = 0):
    """A small Qwen2 (2 layers, 4 heads, 2 KV heads) + the built-in tokenizer, as a Hugging Face directory."""
    from posttrain.models.tiny import create_tiny_model_dir

    return create_tiny_model_dir(
        tmp_path_factory.mktemp(name),
        seed=seed,
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=intermediate_size,
    )


@pytest.fixture(scope="session")
def sandbox() -> LocalSandbox:
    """The real bubblewrap sandbox at tight limits; skipped where no bwrap works, an error in CI (CI=true): CI
    must prove the isolation claims, never skip them."""
    try:
        return LocalSandbox(TIGHT)
    except ConfigError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no working bwrap here: {exc}")


@pytest.fixture(scope="session")
def tok():
    """The built-in tiny tokenizer (a ChatML template, byte-level BPE)."""
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A very small Qwen2 model (attention heads of 16) + the built-in tokenizer."""
    return _tiny_model(tmp_path_factory, "tiny_model", hidden_size=64, intermediate_size=128)


@pytest.fixture(scope="session")
def teacher_model_dir(tmp_path_factory):
    """Another model of tiny_model_dir's shape and tokenizer (other random weights): a distillation teacher."""
    return _tiny_model(tmp_path_factory, "teacher_model", hidden_size=64, intermediate_size=128, seed=1)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "posttrain-cache"))


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    """A tiny Qwen2 whose attention head size (32) vLLM's CPU attention supports (the fixture above has 16)."""
    return _tiny_model(tmp_path_factory, "vllm_tiny_model", hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="session")
def vllm_teacher_dir(tmp_path_factory):
    """Another model of vllm_model_dir's shape and tokenizer (other random weights): a distillation teacher."""
    return _tiny_model(tmp_path_factory, "vllm_teacher_model", hidden_size=128, intermediate_size=256, seed=1)
