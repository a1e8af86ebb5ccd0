"""posttrain's own gateway as the judge's endpoint (what `posttrain serve MODEL_DIR` exposes): the judge's client
against the real server, once with the tiny random model (its verdicts are unreadable: counted and scored by
the rule) and once with a backend that writes a fixed verdict through the real tokenizer and server."""

import pytest

from posttrain.gateway import Gateway
from posttrain.rewards.judge.client import ChatEndpoint
from posttrain.rewards.judge.rubric import load_rubric
from posttrain.rewards.judge.scorer import JudgeScorer
from posttrain.rewards.runner import RewardInput
from tests.gateway.support import scripted_backend

RUBRIC = """\
criteria:
  - name: quality
    template: "Question: {prompt}\\n{response}\\nRate it 0-10. End with VERDICT: <0-10>."
"""


def judge_for(gateway, tmp_path, unparsed_score=0.0):
    path = tmp_path / "rubric.yaml"
    path.write_text(RUBRIC)
    endpoint = ChatEndpoint(
        gateway.base_url, "posttrain", api_key=gateway.api_key, max_tokens=16, max_retries=0
    )
    return JudgeScorer(endpoint, load_rubric(str(path)), unparsed_score=unparsed_score, max_concurrency=2)


SAMPLES = [RewardInput("What is 2+2?", r, "4", {}) for r in ("4", "five", "4")]


def test_a_random_model_behind_the_gateway_gives_unparsed_verdicts(gateway, tmp_path):
    scores, metrics = judge_for(gateway, tmp_path, unparsed_score=0.5).score(SAMPLES)
    assert metrics["reward/judge/calls"] == 2 and metrics["reward/judge/cached"] == 1  # "4" asked once
    assert metrics["reward/judge/failures"] == 0
    assert metrics["reward/judge/unparsed"] == 3 and scores == [0.5] * 3
    assert metrics["reward/judge/tokens"] > 0  # the gateway reports usage


def test_a_verdict_written_through_the_gateway_is_read(tok, tmp_path):
    def reply(request):
        return "Fine.\nVERDICT: 7"

    with Gateway(scripted_backend(tok, reply), tok) as gw:
        scores, metrics = judge_for(gw, tmp_path).score(SAMPLES)
    assert scores == pytest.approx([0.7] * 3) and metrics["reward/judge/unparsed"] == 0
