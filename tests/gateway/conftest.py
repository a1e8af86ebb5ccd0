"""The gateway's tests: the real native engine over the tiny model, the real openai client."""

import pytest

from posttrain.gateway import Gateway
from posttrain.models.hf import load_causal_lm

pytest.importorskip("openai")

from tests.gateway.support import client_for, engine_backend, make_engine  # noqa: E402 (after the skip)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir).float().eval()


@pytest.fixture
def engine(model, tok):
    return make_engine(model, tok)


@pytest.fixture
def gateway(engine, tok):
    with Gateway(engine_backend(engine), tok, max_model_len=512) as gw:
        yield gw


@pytest.fixture
def client(gateway):
    with client_for(gateway.base_url, gateway.api_key) as c:
        yield c
