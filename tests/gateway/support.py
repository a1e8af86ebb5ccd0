"""Helpers of the gateway tests: an engine over the tiny model, the backend over it, a non-retrying client."""

import openai

from posttrain.agents.driver import Generation, engine_generate
from posttrain.rollout.native.engine import NativeEngine


def make_engine(model, tok) -> NativeEngine:
    return NativeEngine(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)


def engine_backend(engine):
    """The gateway's backend over a rollout engine: ``generate_turns`` with the call's sampling settings."""

    def backend(requests, params):
        return engine_generate(engine, params)(requests)

    return backend


def scripted_backend(tok, reply):
    """A backend that "samples" the tokens of ``reply(request)`` + eos (for replies a random model never makes,
    such as tool calls); each token's log-prob is -0.5."""

    def backend(requests, params):
        out = []
        for r in requests:
            ids = tok(reply(r), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = ids[: r.max_tokens]
            out.append(Generation(ids, [-0.5] * len(ids), "eos" if ids[-1] == tok.eos_token_id else "length"))
        return out

    return backend


def client_for(url: str, key: str) -> openai.OpenAI:
    """An openai client that never retries (a refusal must come back as it is)."""
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
