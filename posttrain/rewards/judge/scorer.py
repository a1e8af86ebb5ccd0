"""A judge reward: every sample judged on each rubric criterion by an endpoint, calls concurrent up to a cap and
cached for the run (posttrain.rewards.judge.calls), verdicts read as scores in [0, 1] and averaged with the
criteria's weights.

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
- ``timing/judge``: the seconds :meth:`JudgeScorer.score` took (the maximum over ranks); with questions asked
  during generation (:meth:`JudgeScorer.prefetch`), the time the step still waited for them after it.
"""

from __future__ import annotations

import hashlib
import time
from functools import partial
from typing import TYPE_CHECKING

from posttrain.rewards.judge.calls import SUMMED, TIME, JudgeCalls, Question, Verdict
from posttrain.rewards.judge.client import ChatEndpoint
from posttrain.rewards.judge.rubric import Criterion, Rubric, render, suspicious
from posttrain.rewards.runner import RewardInput

if TYPE_CHECKING:  # torch and transformers load only with a local judge
    from posttrain.rewards.judge.local import LocalJudge

__all__ = ["SUMMED", "TIME", "JudgeScorer", "Verdict", "question_key"]


class JudgeScorer:
    """Scores samples with ``endpoint`` on ``rubric``'s criteria.

    Args:
        endpoint: the judge's chat endpoint (its timeout, retries and failure budget), or a local judge (its
            ``chat_many`` answers the step's questions in batches instead of the thread pool).
        rubric: the criteria.
        unparsed_score: the score in [0, 1] of an unreadable verdict or a failed call.
        max_concurrency: requests in flight at once.
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
        self.rubric = rubric
        self.unparsed_score = unparsed_score
        fallback = f"the criterion scores reward.judge.unparsed_score={unparsed_score}"
        self.calls = JudgeCalls(endpoint, max_concurrency, cache, fallback)

    def score(
        self, samples: list[RewardInput], groups: list[int] | None = None
    ) -> tuple[list[float], dict[str, float]]:
        """The judge score of each sample (weighted mean over the criteria, in [0, 1]) and the call's metrics.
        ``groups`` (which prompt each sample answers) is not needed: each sample is judged alone."""
        start = time.perf_counter()
        keys = [[self._key(c, s) for c in self.rubric.criteria] for s in samples]
        questions: dict[str, Question] = {}  # each distinct question asked once
        for sample, row in zip(samples, keys):
            questions.update(self._questions(sample, row))
        known, fresh = self.calls.answer(questions)
        verdicts = [[known[k] for k in row] for row in keys]
        scores = [self._combine(row) for row in verdicts]
        metrics = self._metrics(samples, verdicts, scores)
        metrics.update(
            self.calls.counts(
                [v for r in verdicts for v in r], fresh, len(samples) * len(self.rubric.criteria)
            )
        )
        metrics[TIME] = time.perf_counter() - start
        return scores, metrics

    def prefetch(self, sample: RewardInput) -> None:
        """Ask about ``sample`` now, as the engine finishes it, so that the :meth:`score` call including it
        finds the verdicts ready (reward/judge/ahead counts them): judging overlaps generation."""
        self.calls.ask_ahead(self._questions(sample, [self._key(c, sample) for c in self.rubric.criteria]))

    def cancel_prefetch(self) -> None:
        """Generation failed: drop the questions asked ahead."""
        self.calls.cancel_ahead()

    def _questions(self, sample: RewardInput, keys: list[str]) -> dict[str, Question]:
        return {
            key: (criterion, partial(self._render, criterion, sample))
            for criterion, key in zip(self.rubric.criteria, keys)
        }

    def _render(self, criterion: Criterion, sample: RewardInput) -> list[dict[str, str]]:
        return render(
            self.rubric, criterion, sample.prompt, sample.response, sample.ground_truth, sample.extra
        )

    def _key(self, criterion: Criterion, sample: RewardInput) -> str:
        return question_key(criterion, sample, sample.response)

    def _combine(self, verdicts: list[Verdict]) -> float:
        total = self.rubric.total_weight()
        parts = (
            c.weight * (self.unparsed_score if v.score is None else v.score)
            for c, v in zip(self.rubric.criteria, verdicts)
        )
        return sum(parts) / total

    def _metrics(
        self, samples: list[RewardInput], verdicts: list[list[Verdict]], scores: list[float]
    ) -> dict[str, float]:
        n = len(samples)
        metrics = {"reward/judge/score_mean": sum(scores) / n if n else 0.0}
        for i, c in enumerate(self.rubric.criteria):
            values = [self.unparsed_score if row[i].score is None else row[i].score for row in verdicts]
            metrics[f"reward/judge/criterion/{c.name}"] = sum(values) / n if n else 0.0
        metrics["reward/judge/suspicious"] = float(sum(suspicious(s.response) for s in samples))
        return metrics


def question_key(criterion: Criterion, sample: RewardInput, *responses: str) -> str:
    """The cache key of a criterion's question about ``responses`` (one, or the two of a pair in the order
    shown) to the sample's prompt: the rubric criterion, the prompt, the responses, the reference and the row's
    fields the template reads."""
    row = {k: str(v) for k, v in sorted(sample.extra.items()) if f"{{row[{k}]}}" in criterion.template}
    text = "\0".join((criterion.key(), sample.prompt, *responses, str(sample.ground_truth), repr(row)))
    return hashlib.sha256(text.encode()).hexdigest()
