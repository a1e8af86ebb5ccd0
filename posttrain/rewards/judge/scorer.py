"""A judge reward: every sample judged on each rubric criterion by an endpoint, calls concurrent up to a cap and
cached for the run, verdicts read as scores in [0, 1] and averaged with the criteria's weights.

A verdict that cannot be read, or a call that failed after its retries, scores ``unparsed_score`` for that
criterion and is counted (``reward/judge/unparsed``, ``reward/judge/failures``): never a silent 0.

Metrics of each :meth:`JudgeScorer.score` call (summed over ranks unless said):

- ``reward/judge/score_mean``: the mean judge score (weighted over criteria), mean over samples;
- ``reward/judge/criterion/<name>``: each criterion's mean score;
- ``reward/judge/calls`` (requests answered), ``reward/judge/cached`` (verdicts reused from the cache or from an
  identical sample of the same call), ``reward/judge/unparsed``, ``reward/judge/failures``,
  ``reward/judge/retries``, ``reward/judge/ahead`` (questions asked during generation, :meth:`JudgeScorer.prefetch`),
  ``reward/judge/suspicious`` (responses holding a delimiter tag or a verdict marker),
  ``reward/judge/tokens`` (tokens the endpoint reported);
- ``timing/judge``: the seconds :meth:`JudgeScorer.score` took (the maximum over ranks); with verdicts asked for
  during generation (:meth:`JudgeScorer.prefetch`), the time the step still waited for them after it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from posttrain.rewards.judge.client import Answer, ChatEndpoint, JudgeCallFailed
from posttrain.rewards.judge.rubric import Criterion, Rubric, render, suspicious
from posttrain.rewards.judge.verdict import parse_verdict
from posttrain.rewards.runner import RewardInput

logger = logging.getLogger("posttrain.rewards.judge")

#: The judge's metrics that are counts (summed over ranks), and its time (the maximum over ranks).
SUMMED = tuple(
    f"reward/judge/{name}"
    for name in ("calls", "ahead", "cached", "unparsed", "failures", "retries", "suspicious", "tokens")
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
        endpoint: the judge's chat endpoint (its timeout, retries and failure budget).
        rubric: the criteria.
        unparsed_score: the score in [0, 1] of an unreadable verdict or a failed call.
        max_concurrency: requests in flight at once.
        cache: reuse the verdict of a (criterion, prompt, response, reference, row) seen before in the run.
    """

    def __init__(
        self,
        endpoint: ChatEndpoint,
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
        # Verdicts asked for during generation (:meth:`prefetch`), collected by the next :meth:`score`.
        self._pending: dict[str, Future] = {}
        self._pending_lock = threading.Lock()
        self._ahead: ThreadPoolExecutor | None = None
        self._retries_reported = 0  # the endpoint's retry count at the last score() (prefetched calls retry too)
        self._logged: set[str] = set()  # the kinds of failed call already logged (each is logged once)
        self._log_lock = threading.Lock()

    def score(self, samples: list[RewardInput]) -> tuple[list[float], dict[str, float]]:
        """The judge score of each sample (weighted mean over the criteria, in [0, 1]) and the call's metrics."""
        start = time.perf_counter()
        jobs = {}  # cache key -> (criterion, sample): each distinct question asked once
        keys = [[_key(c, s) for c in self.rubric.criteria] for s in samples]
        for sample, row in zip(samples, keys):
            for criterion, key in zip(self.rubric.criteria, row):
                if key not in jobs and not (self.use_cache and key in self._cache):
                    jobs[key] = (criterion, sample)
        with self._pending_lock:
            asked_ahead = {key: self._pending.pop(key) for key in list(jobs) if key in self._pending}
        answered = self._ask({k: job for k, job in jobs.items() if k not in asked_ahead})
        answered.update({key: future.result() for key, future in asked_ahead.items()})
        if self.use_cache:
            self._cache.update({k: v for k, v in answered.items() if not v.failed})
        verdicts = [[answered.get(k) or self._cache[k] for k in row] for row in keys]
        scores = [self._combine(row) for row in verdicts]
        metrics = self._metrics(samples, verdicts, scores, answered)
        retries, self._retries_reported = self.endpoint.retries - self._retries_reported, self.endpoint.retries
        metrics["reward/judge/retries"] = float(retries)
        metrics["reward/judge/ahead"] = float(len(asked_ahead))
        metrics[TIME] = time.perf_counter() - start
        return scores, metrics

    def prefetch(self, sample: RewardInput) -> None:
        """Ask the judge about ``sample`` now, in the background (each criterion whose verdict is neither cached
        nor already asked), so that the :meth:`score` call that includes it finds the verdicts ready: judging
        overlaps generation (``reward.score_during_generation``). Thread-safe; at most ``max_concurrency``
        requests in flight."""
        with self._pending_lock:
            for criterion in self.rubric.criteria:
                key = _key(criterion, sample)
                if key in self._pending or (self.use_cache and key in self._cache):
                    continue
                if self._ahead is None:
                    self._ahead = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="judge-ahead")
                self._pending[key] = self._ahead.submit(self._judge, criterion, sample)

    def cancel_prefetch(self) -> None:
        """Drop the verdicts asked for ahead that no :meth:`score` will collect (generation failed): those not
        yet sent are not sent; those in flight end within their timeout."""
        with self._pending_lock:
            for future in self._pending.values():
                future.cancel()
            self._pending.clear()

    def _ask(self, jobs: dict[str, tuple[Criterion, RewardInput]]) -> dict[str, Verdict]:
        if not jobs:
            return {}
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

    def _judge(self, criterion: Criterion, sample: RewardInput) -> Verdict:
        messages = render(
            self.rubric, criterion, sample.prompt, sample.response, sample.ground_truth, sample.extra
        )
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


def _key(criterion: Criterion, sample: RewardInput) -> str:
    """The cache key of a criterion's question about a sample: the rubric criterion, the prompt, the response,
    the reference and the row's fields the template reads."""
    row = {k: str(v) for k, v in sorted(sample.extra.items()) if f"{{row[{k}]}}" in criterion.template}
    text = "\0".join((criterion.key(), sample.prompt, sample.response, str(sample.ground_truth), repr(row)))
    return hashlib.sha256(text.encode()).hexdigest()
