"""The judge over a real HTTP endpoint (a scripted OpenAI-compatible server on 127.0.0.1, posttrain's own
client): scores and metrics, the cache, the concurrency cap, retries, timeouts, garbage, and the failure budget."""

import socket
import threading

import pytest

from posttrain.rewards.judge.client import ChatEndpoint, JudgeUnavailable
from posttrain.rewards.judge.rubric import load_rubric
from posttrain.rewards.judge.scorer import JudgeScorer
from posttrain.rewards.runner import RewardInput
from tests.rewards.judge_server import ScriptedJudge, completion, fenced_response

RUBRIC = """\
criteria:
  - name: short
    weight: 3
    template: "{response}\\nScore 0-10 for brevity. End with VERDICT: <0-10>."
  - name: polite
    verdict: yes_no
    template: "{response}\\nIs it polite? End with VERDICT: yes or no."
"""


def brevity_and_politeness(request):
    """A deterministic judge: brevity 10 - words (at least 0), polite when the response says please."""
    text = fenced_response(request)
    if "brevity" in request["messages"][-1]["content"]:
        return completion(f"Considered.\nVERDICT: {max(0, 10 - len(text.split()))}")
    return completion("VERDICT: yes" if "please" in text else "VERDICT: no")


def scorer(tmp_path, url, **kwargs):
    path = tmp_path / "rubric.yaml"
    path.write_text(RUBRIC)
    endpoint_keys = {
        k: kwargs.pop(k)
        for k in list(kwargs)
        if k in ("timeout_s", "max_retries", "backoff_s", "max_failures", "api_key")
    }
    endpoint = ChatEndpoint(url, "judge-model", **{"backoff_s": 0.0, **endpoint_keys})
    return JudgeScorer(endpoint, load_rubric(str(path)), **kwargs)


def samples(*responses):
    return [RewardInput("Say hi.", r, None, {}) for r in responses]


def test_scores_criteria_and_metrics(tmp_path):
    with ScriptedJudge(brevity_and_politeness) as judge:
        s = scorer(tmp_path, judge.base_url, api_key="sk-test")
        scores, metrics = s.score(samples("hi please", "hello there my good friend how are you"))
    # short: 8/10 and 2/10 (weight 3); polite: 1 and 0 (weight 1)
    assert scores == pytest.approx([(3 * 0.8 + 1) / 4, (3 * 0.2 + 0) / 4])
    assert metrics["reward/judge/criterion/short"] == pytest.approx(0.5)
    assert metrics["reward/judge/criterion/polite"] == pytest.approx(0.5)
    assert metrics["reward/judge/score_mean"] == pytest.approx(sum(scores) / 2)
    assert metrics["reward/judge/calls"] == 4 and metrics["reward/judge/tokens"] == 28
    assert metrics["reward/judge/unparsed"] == 0 and metrics["reward/judge/failures"] == 0
    assert metrics["timing/judge"] > 0
    assert set(judge.auth) == {"Bearer sk-test"}
    assert {r["model"] for r in judge.requests} == {"judge-model"}
    assert {r["temperature"] for r in judge.requests} == {0.0}


def test_the_cache_asks_each_question_once_and_changes_no_score(tmp_path):
    batch = samples("hi please", "hi please", "yo", "hi please")
    with ScriptedJudge(brevity_and_politeness) as judge:
        cached = scorer(tmp_path, judge.base_url)
        first, m1 = cached.score(batch)
        second, m2 = cached.score(batch)
        asked = len(judge.requests)
    with ScriptedJudge(brevity_and_politeness) as judge:
        uncached = scorer(tmp_path, judge.base_url, cache=False)
        plain, m3 = uncached.score(batch)
    assert first == second == plain
    assert (m1["reward/judge/calls"], m1["reward/judge/cached"]) == (
        4,
        4,
    )  # 2 distinct responses x 2 criteria
    assert (m2["reward/judge/calls"], m2["reward/judge/cached"]) == (0, 8)
    assert asked == 4
    assert (m3["reward/judge/calls"], m3["reward/judge/cached"]) == (4, 4)  # a call's duplicates still shared


def test_requests_in_flight_stay_under_the_cap(tmp_path):
    with ScriptedJudge(brevity_and_politeness, delay_s=0.05) as judge:
        scorer(tmp_path, judge.base_url, max_concurrency=3).score(samples(*[f"r{i}" for i in range(12)]))
    assert len(judge.requests) == 24
    assert judge.max_in_flight == 3


def test_unparsed_verdicts_are_counted_and_scored_by_the_rule(tmp_path):
    def rambling(request):
        if "brevity" in request["messages"][-1]["content"]:
            return completion("I would say it is quite short.")
        return completion("VERDICT: yes")

    with ScriptedJudge(rambling) as judge:
        scores, metrics = scorer(tmp_path, judge.base_url, unparsed_score=0.5).score(samples("a", "b"))
    assert metrics["reward/judge/unparsed"] == 2 and metrics["reward/judge/failures"] == 0
    assert scores == pytest.approx([(3 * 0.5 + 1) / 4] * 2)


def test_http_errors_and_garbage_are_retried(tmp_path):
    calls = {"n": 0}
    lock = threading.Lock()

    def flaky(request):
        with lock:
            calls["n"] += 1
            n = calls["n"]
        if n % 3 == 1:
            return 503, b'{"error": "busy"}'
        if n % 3 == 2:
            return 200, b"<html>not json</html>"
        return brevity_and_politeness(request)

    with ScriptedJudge(flaky) as judge:
        scores, metrics = scorer(tmp_path, judge.base_url, max_retries=2, max_concurrency=1).score(
            samples("hi please")
        )
    assert scores == pytest.approx([(3 * 0.8 + 1) / 4])
    assert metrics["reward/judge/retries"] == 4 and metrics["reward/judge/failures"] == 0


def test_failed_calls_are_counted_then_the_budget_stops_the_run(tmp_path):
    with ScriptedJudge(lambda request: (500, b"{}")) as judge:
        s = scorer(tmp_path, judge.base_url, max_retries=1, max_failures=3, unparsed_score=0.25)
        scores, metrics = s.score(samples("a"))  # 2 failed calls: within the budget
        assert metrics["reward/judge/failures"] == 2 and metrics["reward/judge/retries"] == 2
        assert scores == [0.25]
        with pytest.raises(
            JudgeUnavailable, match=r"judge endpoint http://127\.0\.0\.1:\d+/v1/chat/completions"
        ) as info:
            s.score(samples("b"))
        assert "reward.judge.max_failures=3" in str(info.value) and "HTTP 500" in str(info.value)


def test_a_slow_endpoint_times_out(tmp_path):
    with ScriptedJudge(brevity_and_politeness, delay_s=1.0) as judge:
        s = scorer(tmp_path, judge.base_url, timeout_s=0.2, max_retries=0, max_failures=10)
        scores, metrics = s.score(samples("a"))
    assert metrics["reward/judge/failures"] == 2 and scores == [0.0]


def test_a_down_endpoint_stops_the_run_naming_it(tmp_path):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = scorer(tmp_path, f"http://127.0.0.1:{port}/v1", max_retries=1, max_failures=0)
    with pytest.raises(
        JudgeUnavailable, match=rf"127\.0\.0\.1:{port}/v1/chat/completions.*Connection refused"
    ):
        s.score(samples("a"))


def test_after_the_budget_runs_out_nothing_more_is_asked(tmp_path):
    with ScriptedJudge(lambda request: (500, b"{}")) as judge:
        s = scorer(tmp_path, judge.base_url, max_retries=0, max_failures=0, max_concurrency=1)
        with pytest.raises(JudgeUnavailable):
            s.score(samples(*[f"r{i}" for i in range(10)]))
        assert len(judge.requests) <= 2  # the failing call, and at most one already started
