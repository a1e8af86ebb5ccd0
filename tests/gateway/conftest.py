"""The gateway's tests: the real native engine over the tiny model, the real openai client (the optional
extra ``posttrain[agents-api]``, part of ``[dev]``; in an environment without it, such as the vLLM one, these
tests are not collected)."""

import importlib.util

import pytest

from posttrain.gateway import Gateway
from posttrain.models.hf import load_causal_lm

if importlib.util.find_spec("openai") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir).float().eval()


@pytest.fixture
def engine(model, tok):
    from tests.gateway.support import make_engine

    return make_engine(model, tok)


@pytest.fixture
def gateway(engine, tok):
    from tests.gateway.support import engine_backend

    with Gateway(engine_backend(engine), tok, max_model_len=512) as gw:
        yield gw


@pytest.fixture
def client(gateway):
    from tests.gateway.support import client_for

    with client_for(gateway.base_url, gateway.api_key) as c:
        yield c
