"""What every judge scorer shares: questions asked concurrently up to a cap, each answered verdict cached for the
run under a key naming the question, failed calls logged once per kind, and the call counts every mode reports.

A question is a criterion and a function rendering its chat messages; the messages are rendered in the worker
thread that asks them, so each call draws its own fence ids (posttrain.rewards.judge.rubric).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from posttrain.rewards.judge.client import ChatEndpoint, JudgeCallFailed
from posttrain.rewards.judge.rubric import Criterion
from posttrain.rewards.judge.verdict import parse_verdict

logger = logging.getLogger("posttrain.rewards.judge")

#: The judge's metrics that are counts (summed over ranks), and its time (the maximum over ranks).
SUMMED = tuple(
    f"reward/judge/{name}"
    for name in (
        "calls",
        "cached",
        "unparsed",
        "failures",
        "retries",
        "suspicious",
        "tokens",
        "pairwise/inconsistent",
        "pairwise/identical",
        "pairwise/unpaired",
    )
)
TIME = "timing/judge"

#: A question to the judge: the criterion its verdict is read by, and a function rendering its messages.
Question = tuple[Criterion, Callable[[], list[dict[str, str]]]]


@dataclass(frozen=True)
class Verdict:
    """One criterion's verdict on one question: its score in [0, 1] (None: unparsed or failed)."""

    score: float | None
    tokens: int = 0
    failed: bool = False


class JudgeCalls:
    """Asks questions of ``endpoint``: at most ``max_concurrency`` in flight, each distinct key asked once per
    :meth:`answer` call, and (``cache``) never again in the run once answered. ``fallback`` says in the log
    what a failed call scores."""

    def __init__(self, endpoint: ChatEndpoint, max_concurrency: int, cache: bool, fallback: str) -> None:
        self.endpoint = endpoint
        self.max_concurrency = max_concurrency
        self.use_cache = cache
        self.fallback = fallback
        self._cache: dict[str, Verdict] = {}
        self._logged: set[str] = set()  # the kinds of failed call already logged (each is logged once)
        self._log_lock = threading.Lock()

    def answer(self, questions: dict[str, Question]) -> tuple[dict[str, Verdict], dict[str, Verdict]]:
        """The verdict of every key of ``questions`` (from the cache or asked now), and those asked now."""
        jobs = {k: q for k, q in questions.items() if not (self.use_cache and k in self._cache)}
        fresh = self._ask(jobs)
        if self.use_cache:
            self._cache.update({k: v for k, v in fresh.items() if not v.failed})
        return {k: fresh.get(k) or self._cache[k] for k in questions}, fresh

    def counts(self, verdicts: list[Verdict], fresh: dict[str, Verdict], asked: int) -> dict[str, float]:
        """The call counts of one scoring: ``verdicts`` (every verdict used, once per use), ``fresh`` (those
        asked now) and ``asked`` (verdicts used, including the uses that needed no call)."""
        answered = list(fresh.values())
        return {
            "reward/judge/calls": float(sum(not v.failed for v in answered)),
            "reward/judge/cached": float(asked - len(answered)),
            "reward/judge/unparsed": float(sum(v.score is None and not v.failed for v in verdicts)),
            "reward/judge/failures": float(sum(v.failed for v in verdicts)),
            "reward/judge/tokens": float(sum(v.tokens for v in answered)),
        }

    def _ask(self, jobs: dict[str, Question]) -> dict[str, Verdict]:
        if not jobs:
            return {}
        pool = ThreadPoolExecutor(min(self.max_concurrency, len(jobs)), thread_name_prefix="judge")
        try:
            futures = {key: pool.submit(self._judge, c, render) for key, (c, render) in jobs.items()}
            answered = {key: future.result() for key, future in futures.items()}
        except BaseException:
            # The failure budget ran out, or Ctrl-C / SIGTERM: ask nothing more; the requests in flight end
            # within their timeout on their own rather than holding up the stop.
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        return answered

    def _judge(self, criterion: Criterion, render: Callable[[], list[dict[str, str]]]) -> Verdict:
        try:
            answer = self.endpoint.chat(render())
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
            "a judge call to %s failed after %d tries (%s); %s. Only the first failure of each kind is logged; "
            "all are counted in reward/judge/failures.",
            self.endpoint.url,
            self.endpoint.max_retries + 1,
            error,
            self.fallback,
        )
