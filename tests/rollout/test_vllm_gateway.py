"""The gateway over the vLLM engine's ``generate_turns``: a harness's appending calls (HTTP, one session per
trajectory) are captured as one chain, and the trainer's recomputed log-probs of the sampled ids match vLLM's to
1e-5, the tolerance the other vLLM-vs-trainer log-prob tests use (tests/rollout/test_vllm_turns.py,
test_vllm_engine.py; fp32 on both sides). Template and user tokens are mask 0.

Runs in the vLLM environment only (``pytest -m vllm``). That environment has no ``openai`` package, so the
harness here speaks the wire format with the standard library (urllib), as any HTTP client would.
"""

import json
import os
import urllib.request

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from posttrain.agents.driver import engine_generate  # noqa: E402
from posttrain.gateway.assemble import assemble  # noqa: E402
from posttrain.gateway.server import Gateway  # noqa: E402
from posttrain.rollout.base import SamplingParams  # noqa: E402
from posttrain.rollout.vllm import VLLMEngine, VLLMKnobs  # noqa: E402

PROMPTS = ["What is 2+2? Think about it for a while.", "Name a colour, then a fruit, then a tree."]
PARAMS = SamplingParams(max_tokens=64, temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def engine(vllm_model_dir, tok):
    knobs = VLLMKnobs(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024, load_format="auto")
    eng = VLLMEngine(vllm_model_dir, [tok.eos_token_id], dtype="fp32", seed=0, knobs=knobs)
    yield eng
    eng.close()


def chat(base_url: str, api_key: str, messages: list[dict]) -> dict:
    body = json.dumps({"model": "policy", "messages": messages, "max_tokens": 8}).encode()
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    request = urllib.request.Request(f"{base_url}/chat/completions", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.load(answer)


def three_calls(base_url: str, api_key: str, prompt: str) -> None:
    """An appending harness: ask, then two follow-ups on the answers."""
    messages = [{"role": "user", "content": prompt}]
    for follow_up in ("Sure?", "Once more."):
        reply = chat(base_url, api_key, messages)["choices"][0]["message"]
        messages += [
            {"role": "assistant", "content": reply["content"]},
            {"role": "user", "content": follow_up},
        ]
    chat(base_url, api_key, messages)


def test_gateway_over_vllm_captures_ids_whose_trainer_log_probs_match(engine, vllm_model_dir, tok):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()
    backend = lambda requests, params: engine_generate(engine, params)(requests)  # noqa: E731
    samples = []
    with Gateway(backend, tok, max_model_len=1024) as gateway:
        for k, prompt in enumerate(PROMPTS):
            session = gateway.open_session(sample_id=k, params=PARAMS, max_response_tokens=96)
            three_calls(session.base_url, session.api_key, prompt)
            records = gateway.close_session(session.id)
            assert len(records) == 3 and all(r.extends_previous for r in records[1:])
            samples.append(assemble(records, "last", 96, sample_id=k).trajectory)
    worst = 0.0
    for t in samples:
        seq = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logits = hf_model(seq, use_cache=False).logits[0, len(t.prompt_ids) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, seq[0, len(t.prompt_ids) :, None])[:, 0]
        keep = torch.tensor(t.mask, dtype=torch.bool)
        assert keep.sum() > 0 and (~keep).sum() > 0  # sampled ids and template/user tokens both
        assert torch.all(torch.tensor(t.logprobs)[~keep] == 0)
        worst = max(worst, (torch.tensor(t.logprobs)[keep] - expected[keep]).abs().max().item())
    assert worst <= 1e-5
