"""echo=true completions on the gateway: the served model's log-probs of each prompt token (token ids or text)
at the request's temperature, as vLLM's OpenAI server answers them (null for the first token, nothing
generated); every malformed echo request is a clean 400."""

import openai
import pytest
import torch

from posttrain.gateway import Gateway
from posttrain.gateway.prompt_scores import PromptScorer
from tests.gateway.support import client_for, engine_backend

IDS = [5, 9, 3, 20, 21, 22, 23]


@pytest.fixture
def scoring(engine, model, tok):
    scorer = PromptScorer(model)
    with (
        Gateway(engine_backend(engine), tok, max_model_len=64, prompt_scorer=scorer) as gw,
        client_for(gw.base_url, gw.api_key) as c,
    ):
        yield c


def _expected(model, ids, temperature):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("temperature", [None, 1.0, 0.6])
def test_echo_gives_each_prompt_tokens_log_prob(scoring, model, temperature):
    extra = {} if temperature is None else {"temperature": temperature}
    r = scoring.completions.create(model="policy", prompt=IDS, echo=True, logprobs=1, max_tokens=0, **extra)
    choice, raw = r.choices[0], r.model_dump()["choices"][0]
    lps = choice.logprobs.token_logprobs
    assert lps[0] is None and len(lps) == len(IDS) and raw["token_ids"] == IDS
    torch.testing.assert_close(
        torch.tensor(lps[1:]), _expected(model, IDS, temperature or 1.0), atol=1e-6, rtol=0
    )
    assert r.usage.prompt_tokens == len(IDS) and r.usage.completion_tokens == 0
    assert choice.logprobs.top_logprobs[0] is None and len(choice.logprobs.top_logprobs[1]) == 1


def test_top_logprobs_are_the_models_most_likely_tokens(scoring, model, tok):
    r = scoring.completions.create(model="policy", prompt=IDS, echo=True, logprobs=3, max_tokens=0)
    top = r.choices[0].logprobs.top_logprobs[2]
    with torch.no_grad():
        row = torch.log_softmax(model(input_ids=torch.tensor([IDS[:2]])).logits[0, -1].float(), -1)
    values, ids = row.topk(3)
    assert len(top) == len({tok.decode([i]) for i in ids.tolist()})
    assert sorted(top.values(), reverse=True) == pytest.approx(values.tolist(), abs=1e-6)


def test_a_text_prompt_is_scored_as_its_tokens(scoring, tok):
    r = scoring.completions.create(
        model="policy", prompt="Once upon a time", echo=True, logprobs=0, max_tokens=0
    )
    assert r.model_dump()["choices"][0]["token_ids"] == tok("Once upon a time")["input_ids"]
    assert r.choices[0].text == "Once upon a time"


BAD = {
    "generation": ({"max_tokens": 4}, "max_tokens.*send max_tokens=0"),
    "no-max-tokens": ({}, "max_tokens.*send max_tokens=0"),
    "stream": ({"max_tokens": 0, "stream": True}, "stream"),
    "not-a-bool": ({"max_tokens": 0, "echo": "yes"}, "echo.*true or false"),
    "too-long": ({"max_tokens": 0, "prompt": list(range(5, 80))}, "context is 64 tokens"),
    "zero-without-echo": ({"max_tokens": 0, "echo": False}, "max_tokens.*>= 1"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_echo_requests_get_400(scoring, name):
    fields, message = BAD[name]
    body = {"model": "policy", "prompt": IDS, "echo": True, "logprobs": 1, **fields}
    with pytest.raises(openai.BadRequestError, match=message):
        scoring.completions.create(**body)


def test_a_gateway_without_a_scorer_refuses_echo(client):
    with pytest.raises(openai.BadRequestError, match="does not score prompts"):
        client.completions.create(model="policy", prompt=IDS, echo=True, logprobs=1, max_tokens=0)


def test_concurrent_requests_share_forwards_and_get_their_own_scores(model):
    """Requests arriving while a forward runs go together in one right-padded forward; each gets the log-probs a
    forward of its prompt alone gives (fp32), whatever the other prompts' lengths."""
    import threading

    prompts = [IDS[: 2 + i % 6] + [30 + i] * (i % 3) for i in range(8)]
    scorer = PromptScorer(model)
    alone = [scorer(ids, 0.7, 3) for ids in prompts]
    assert scorer.forwards == 8
    results = [None] * len(prompts)

    def ask(i):
        results[i] = scorer(prompts[i], 0.7, 3)

    with scorer._model_lock:  # hold the model while all eight arrive: they must then go as one batch
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        while len(scorer._queue) < len(prompts):
            threading.Event().wait(0.01)
    for t in threads:
        t.join()
    assert scorer.forwards == 9
    for got, want in zip(results, alone):
        assert got.logprobs[0] is None
        torch.testing.assert_close(
            torch.tensor(got.logprobs[1:]), torch.tensor(want.logprobs[1:]), atol=1e-5, rtol=0
        )
        assert [sorted(t) for t in got.top[1:]] == [sorted(t) for t in want.top[1:]]


def test_a_batch_within_the_token_budget(model):
    """Waiting prompts go in arrival order while the padded batch fits max_batch_tokens (at least one)."""
    scorer = PromptScorer(model, max_batch_tokens=16)
    from posttrain.gateway.prompt_scores import _Waiting

    scorer._queue = [_Waiting([1] * 5), _Waiting([1] * 7), _Waiting([1] * 3), _Waiting([1] * 20)]
    assert [len(w.ids) for w in scorer._take()] == [5, 7]  # 3 rows x 7 = 21 > 16
    assert [len(w.ids) for w in scorer._take()] == [3]
    assert [len(w.ids) for w in scorer._take()] == [20]  # alone over the budget: still one
