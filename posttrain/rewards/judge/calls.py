"""What every judge scorer shares: questions asked concurrently up to a cap, each answered verdict cached for the
run under a key naming the question, failed calls logged once per kind, and the call counts every mode reports.

A question is a criterion and a function rendering its chat messages; the messages are rendered in the worker
thread that asks them, so each call draws its own fence ids (posttrain.rewards.judge.rubric).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from posttrain.rewards.judge.client import ChatEndpoint, JudgeCallFailed
from posttrain.rewards.judge.rubric import Criterion
from posttrain.rewards.judge.verdict import parse_verdict

if TYPE_CHECKING:  # torch and transformers load only with a local judge
    from posttrain.rewards.judge.local import LocalJudge

logger = logging.getLogger("posttrain.rewards.judge")

#: The judge's metrics that are counts (summed over ranks), and its time (the maximum over ranks).
SUMMED = tuple(
    f"reward/judge/{name}"
    for name in (
        "calls",
        "ahead",
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

    def __init__(
        self, endpoint: ChatEndpoint | LocalJudge, max_concurrency: int, cache: bool, fallback: str
    ) -> None:
        self.endpoint = endpoint
        self.max_concurrency = max_concurrency
        self.use_cache = cache
        self.fallback = fallback
        self._cache: dict[str, Verdict] = {}
        self._logged: set[str] = set()  # the kinds of failed call already logged (each is logged once)
        self._log_lock = threading.Lock()
        # Questions asked during generation (:meth:`ask_ahead`), collected by the next :meth:`answer`.
        self._pending: dict[str, Future] = {}
        self._pending_lock = threading.Lock()
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._ahead_used = 0  # of the last answer() call
        self._retries_reported = 0  # the endpoint's retry count at the last counts() (calls ahead retry too)

    def ask_ahead(self, questions: dict[str, Question]) -> None:
        """Ask ``questions`` now, in the background (those neither cached nor already asked), so that the
        :meth:`answer` call that includes them finds their verdicts ready: judging overlaps generation.
        Thread-safe; at most ``max_concurrency`` requests of these in flight."""
        with self._pending_lock:
            for key, (criterion, render) in questions.items():
                if key in self._pending or (self.use_cache and key in self._cache):
                    continue
                if self._ahead_pool is None:
                    self._ahead_pool = ThreadPoolExecutor(
                        self.max_concurrency, thread_name_prefix="judge-ahead"
                    )
                self._pending[key] = self._ahead_pool.submit(self._judge, criterion, render)

    def cancel_ahead(self) -> None:
        """Drop the questions asked ahead that no :meth:`answer` will collect (generation failed): those not yet
        sent are not sent; those in flight end within their timeout."""
        with self._pending_lock:
            for future in self._pending.values():
                future.cancel()
            self._pending.clear()

    def answer(self, questions: dict[str, Question]) -> tuple[dict[str, Verdict], dict[str, Verdict]]:
        """The verdict of every key of ``questions`` (from the cache, asked ahead, or asked now), and those
        asked ahead or now."""
        jobs = {k: q for k, q in questions.items() if not (self.use_cache and k in self._cache)}
        with self._pending_lock:
            ahead = {k: self._pending.pop(k) for k in list(jobs) if k in self._pending}
        fresh = self._ask({k: q for k, q in jobs.items() if k not in ahead})
        fresh.update({k: future.result() for k, future in ahead.items()})
        self._ahead_used = len(ahead)
        if self.use_cache:
            self._cache.update({k: v for k, v in fresh.items() if not v.failed})
        return {k: fresh.get(k) or self._cache[k] for k in questions}, fresh

    def counts(self, verdicts: list[Verdict], fresh: dict[str, Verdict], asked: int) -> dict[str, float]:
        """The call counts of one scoring: ``verdicts`` (every verdict used, once per use), ``fresh`` (those
        asked ahead or now) and ``asked`` (verdicts used, including the uses that needed no call); and the
        retries since the last scoring."""
        answered = list(fresh.values())
        retries, self._retries_reported = (
            self.endpoint.retries - self._retries_reported,
            self.endpoint.retries,
        )
        return {
            "reward/judge/calls": float(sum(not v.failed for v in answered)),
            "reward/judge/ahead": float(self._ahead_used),
            "reward/judge/retries": float(retries),
            "reward/judge/cached": float(asked - len(answered)),
            "reward/judge/unparsed": float(sum(v.score is None and not v.failed for v in verdicts)),
            "reward/judge/failures": float(sum(v.failed for v in verdicts)),
            "reward/judge/tokens": float(sum(v.tokens for v in answered)),
        }

    def _ask(self, jobs: dict[str, Question]) -> dict[str, Verdict]:
        if not jobs:
            return {}
        if hasattr(self.endpoint, "chat_many"):  # a local judge: batched generate calls, no threads
            return self._ask_batched(jobs)
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

    def _ask_batched(self, jobs: dict[str, Question]) -> dict[str, Verdict]:
        answers = self.endpoint.chat_many([render() for _, render in jobs.values()])
        return {
            key: Verdict(parse_verdict(a.text, c.verdict, c.low, c.high), a.tokens)
            for (key, (c, _)), a in zip(jobs.items(), answers)
        }

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
