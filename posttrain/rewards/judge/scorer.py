"""A judge reward: every sample judged on each rubric criterion by an endpoint, calls concurrent up to a cap and
cached for the run, verdicts read as scores in [0, 1] and averaged with the criteria's weights.

A verdict that cannot be read, or a call that failed after its retries, scores ``unparsed_score`` for that
criterion and is counted (``reward/judge/unparsed``, ``reward/judge/failures``): never a silent 0.

Metrics of each :meth:`JudgeScorer.score` call (summed over ranks unless said):

- ``reward/judge/score_mean``: the mean judge score (weighted over criteria), mean over samples;
- ``reward/judge/criterion/<name>``: each criterion's mean score;
- ``reward/judge/calls`` (requests answered), ``reward/judge/cached`` (verdicts reused from the cache or from an
  identical sample of the same call), ``reward/judge/unparsed``, ``reward/judge/failures``,
  ``reward/judge/retries``, ``reward/judge/suspicious`` (responses holding a delimiter tag or a verdict marker),
  ``reward/judge/tokens`` (tokens the endpoint reported);
- ``timing/judge``: the seconds judging took (the maximum over ranks).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from posttrain.rewards.judge.client import Answer, ChatEndpoint, JudgeCallFailed
from posttrain.rewards.judge.local import LocalJudge
from posttrain.rewards.judge.rubric import Criterion, Rubric, render, suspicious
from posttrain.rewards.judge.verdict import parse_verdict
from posttrain.rewards.runner import RewardInput

logger = logging.getLogger("posttrain.rewards.judge")

#: The judge's metrics that are counts (summed over ranks), and its time (the maximum over ranks).
SUMMED = tuple(
    f"reward/judge/{name}"
    for name in ("calls", "cached", "unparsed", "failures", "retries", "suspicious", "tokens")
)
TIME = "timing/judge"


@dataclass(frozen=True)
class Verdict:
    """One criterion's verdict on one sample: its score in [0, 1] (None: unparsed or failed)."""

    score: float | None
    tokens: int = 0
    failed: bool = False


class JudgeScorer:
    """Scores samples with ``endpoint`` on ``rubric``'s criteria.

    Args:
        endpoint: the judge's chat endpoint (its timeout, retries and failure budget), or a local judge (its
            ``chat_many`` answers the step's questions in batches instead of the thread pool).
        rubric: the criteria.
        unparsed_score: the score in [0, 1] of an unreadable verdict or a failed call.
        max_concurrency: requests in flight at once (an endpoint's).
        cache: reuse the verdict of a (criterion, prompt, response, reference, row) seen before in the run.
    """

    def __init__(
        self,
        endpoint: ChatEndpoint | LocalJudge,
        rubric: Rubric,
        unparsed_score: float = 0.0,
        max_concurrency: int = 8,
        cache: bool = True,
    ) -> None:
        self.endpoint = endpoint
        self.rubric = rubric
        self.unparsed_score = unparsed_score
        self.max_concurrency = max_concurrency
        self.use_cache = cache
        self._cache: dict[str, Verdict] = {}
        self._logged: set[str] = set()  # the kinds of failed call already logged (each is logged once)
        self._log_lock = threading.Lock()

    def score(self, samples: list[RewardInput]) -> tuple[list[float], dict[str, float]]:
        """The judge score of each sample (weighted mean over the criteria, in [0, 1]) and the call's metrics."""
        start = time.perf_counter()
        retries_before = self.endpoint.retries
        jobs = {}  # cache key -> (criterion, sample): each distinct question asked once
        keys = [[_key(c, s) for c in self.rubric.criteria] for s in samples]
        for sample, row in zip(samples, keys):
            for criterion, key in zip(self.rubric.criteria, row):
                if key not in jobs and not (self.use_cache and key in self._cache):
                    jobs[key] = (criterion, sample)
        answered = self._ask(jobs)
        if self.use_cache:
            self._cache.update({k: v for k, v in answered.items() if not v.failed})
        verdicts = [[answered.get(k) or self._cache[k] for k in row] for row in keys]
        scores = [self._combine(row) for row in verdicts]
        metrics = self._metrics(samples, verdicts, scores, answered)
        metrics["reward/judge/retries"] = float(self.endpoint.retries - retries_before)
        metrics[TIME] = time.perf_counter() - start
        return scores, metrics

    def _ask(self, jobs: dict[str, tuple[Criterion, RewardInput]]) -> dict[str, Verdict]:
        if not jobs:
            return {}
        if hasattr(self.endpoint, "chat_many"):  # a local judge: one batched generate per batch, no threads
            return self._ask_batched(jobs)
        pool = ThreadPoolExecutor(min(self.max_concurrency, len(jobs)), thread_name_prefix="judge")
        try:
            futures = {key: pool.submit(self._judge, c, s) for key, (c, s) in jobs.items()}
            answered = {key: future.result() for key, future in futures.items()}
        except BaseException:
            # The failure budget ran out, or Ctrl-C / SIGTERM: ask nothing more; the requests in flight end
            # within their timeout on their own rather than holding up the stop.
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        return answered

    def _ask_batched(self, jobs: dict[str, tuple[Criterion, RewardInput]]) -> dict[str, Verdict]:
        questions = [_messages(self.rubric, c, s) for c, s in jobs.values()]
        answers = self.endpoint.chat_many(questions)
        verdicts = {}
        for (key, (criterion, _)), answer in zip(jobs.items(), answers):
            score = parse_verdict(answer.text, criterion.verdict, criterion.low, criterion.high)
            verdicts[key] = Verdict(score, answer.tokens)
        return verdicts

    def _judge(self, criterion: Criterion, sample: RewardInput) -> Verdict:
        messages = _messages(self.rubric, criterion, sample)
        try:
            answer: Answer = self.endpoint.chat(messages)
        except JudgeCallFailed as exc:
            self._log_failure(str(exc))
            return Verdict(None, failed=True)
        score = parse_verdict(answer.text, criterion.verdict, criterion.low, criterion.high)
        return Verdict(score, answer.tokens)

    def _log_failure(self, error: str) -> None:
        kind = error.split(":")[0][:40]
        with self._log_lock:
            if kind in self._logged:
                return
            self._logged.add(kind)
        logger.warning(
            "a judge call to %s failed after %d tries (%s); the criterion scores reward.judge.unparsed_score=%s. "
            "Only the first failure of each kind is logged; all are counted in reward/judge/failures.",
            self.endpoint.url,
            self.endpoint.max_retries + 1,
            error,
            self.unparsed_score,
        )

    def _combine(self, verdicts: list[Verdict]) -> float:
        total = self.rubric.total_weight()
        parts = (
            c.weight * (self.unparsed_score if v.score is None else v.score)
            for c, v in zip(self.rubric.criteria, verdicts)
        )
        return sum(parts) / total

    def _metrics(
        self,
        samples: list[RewardInput],
        verdicts: list[list[Verdict]],
        scores: list[float],
        answered: dict[str, Verdict],
    ) -> dict[str, float]:
        n = len(samples)
        asked = sum(len(row) for row in verdicts)
        fresh = list(answered.values())
        metrics = {"reward/judge/score_mean": sum(scores) / n if n else 0.0}
        for i, c in enumerate(self.rubric.criteria):
            values = [self.unparsed_score if row[i].score is None else row[i].score for row in verdicts]
            metrics[f"reward/judge/criterion/{c.name}"] = sum(values) / n if n else 0.0
        metrics.update(
            {
                "reward/judge/calls": float(sum(not v.failed for v in fresh)),
                "reward/judge/cached": float(asked - len(fresh)),
                "reward/judge/unparsed": float(
                    sum(v.score is None and not v.failed for r in verdicts for v in r)
                ),
                "reward/judge/failures": float(sum(v.failed for r in verdicts for v in r)),
                "reward/judge/suspicious": float(sum(suspicious(s.response) for s in samples)),
                "reward/judge/tokens": float(sum(v.tokens for v in fresh)),
            }
        )
        return metrics


def _messages(rubric: Rubric, criterion: Criterion, sample: RewardInput) -> list[dict[str, str]]:
    return render(rubric, criterion, sample.prompt, sample.response, sample.ground_truth, sample.extra)


def _key(criterion: Criterion, sample: RewardInput) -> str:
    """The cache key of a criterion's question about a sample: the rubric criterion, the prompt, the response,
    the reference and the row's fields the template reads."""
    row = {k: str(v) for k, v in sorted(sample.extra.items()) if f"{{row[{k}]}}" in criterion.template}
    text = "\0".join((criterion.key(), sample.prompt, sample.response, str(sample.ground_truth), repr(row)))
    return hashlib.sha256(text.encode()).hexdigest()
