"""Pairwise judging (reward.judge.mode=pairwise): the samples of one prompt's group compared two at a time on
each rubric criterion, every pair asked in both orders, and each sample scored by its win rate.

A judge that favours the response it sees first (position bias) would otherwise hand the win to whichever
sample happened to be shown first; asking (A, B) and (B, A) gives each response both places, so a constant bias
adds one win and one loss to each side and cancels. A sample's score on a criterion is its share of the
comparisons it took part in: a win counts 1, a tie 0.5, a loss 0; the criteria combine with their weights as in
pointwise mode. An unreadable verdict or a failed call counts as a tie (and in ``reward/judge/unparsed`` /
``reward/judge/failures``); two identical responses tie without a call; a sample with no other sample in its
group (nothing to compare with) scores 0.5 and is counted in ``reward/judge/pairwise/unpaired``.

Opponents: with ``opponents`` = 0 every pair of the group is compared (n samples: n(n-1)/2 pairs, n(n-1) calls
per criterion); with k > 0 each sample is paired with the next k samples of its group taken as a ring, so a
group makes n*k pairs (fewer when 2k >= n-1 and pairs coincide) and each sample plays about 2k of them.

Metrics, besides the pointwise ones (posttrain.rewards.judge.scorer):

- ``reward/judge/pairwise/first_wins``: the share of decided comparisons (neither a tie nor unparsed) won by
  the response shown first; 0.5 means no position bias, 1.0 a judge that always picks A (0.5 when none was
  decided);
- ``reward/judge/pairwise/inconsistent``: (pair, criterion) whose two orders, both readable, disagree;
- ``reward/judge/pairwise/identical``: pairs of identical responses (tied without a call);
- ``reward/judge/pairwise/unpaired``: samples alone in their group.
"""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING

from posttrain.rewards.judge.calls import TIME, JudgeCalls, Question, Verdict
from posttrain.rewards.judge.client import ChatEndpoint
from posttrain.rewards.judge.rubric import Criterion, Rubric, render_pair, suspicious
from posttrain.rewards.judge.scorer import question_key
from posttrain.rewards.runner import RewardInput

if TYPE_CHECKING:  # torch and transformers load only with a local judge
    from posttrain.rewards.judge.local import LocalJudge

#: The score of a comparison that could not be read, and of a sample with nothing to compare with.
TIE = 0.5


def ring_pairs(size: int, opponents: int) -> list[tuple[int, int]]:
    """The pairs (i < j) of positions in a group of ``size`` compared: all of them (``opponents`` = 0), else each
    position with the next ``opponents`` positions, wrapping around."""
    k = size - 1 if opponents == 0 else min(opponents, size - 1)
    pairs = {tuple(sorted((p, (p + d) % size))) for p in range(size) for d in range(1, k + 1)}
    return sorted(pairs)


class PairwiseJudgeScorer:
    """Scores each sample by its win rate against the other samples of its group on ``rubric``'s criteria
    (the module doc).

    Args:
        endpoint: the judge's chat endpoint (its timeout, retries and failure budget).
        rubric: a pairwise rubric (``{response_a}``, ``{response_b}``, verdict ``choice``).
        opponents: 0 compares every pair of a group; k > 0 pairs each sample with the next k of its group.
        max_concurrency: requests in flight at once.
        cache: reuse the verdict of a (criterion, prompt, first, second, reference, row) seen before in the run.
    """

    def __init__(
        self,
        endpoint: ChatEndpoint | LocalJudge,
        rubric: Rubric,
        opponents: int = 0,
        max_concurrency: int = 8,
        cache: bool = True,
    ) -> None:
        self.rubric = rubric
        self.opponents = opponents
        self.calls = JudgeCalls(endpoint, max_concurrency, cache, "the comparison counts as a tie")

    def score(
        self, samples: list[RewardInput], groups: list[int] | None = None
    ) -> tuple[list[float], dict[str, float]]:
        """The win rate of each sample (weighted over the criteria, in [0, 1]) and the call's metrics;
        ``groups[s]`` names the group (the prompt) of sample s: only samples of one group are compared."""
        if groups is None or len(groups) != len(samples):
            raise ValueError(f"pairwise judging needs the group of each of the {len(samples)} samples")
        start = time.perf_counter()
        pairs, identical, unpaired = self._pairs(samples, groups)
        questions: dict[str, Question] = {}
        keys = {}  # (criterion index, first, second) -> the question's key
        for c, criterion in enumerate(self.rubric.criteria):
            for i, j in pairs:
                for first, second in ((i, j), (j, i)):
                    key = question_key(
                        criterion, samples[i], samples[first].response, samples[second].response
                    )
                    keys[c, first, second] = key
                    render = partial(self._render, criterion, samples[i], first, second, samples)
                    questions.setdefault(key, (criterion, render))
        known, fresh = self.calls.answer(questions)
        used = {k: known[key] for k, key in keys.items()}  # (criterion, first, second) -> verdict
        per_criterion = [
            self._win_rates(c, len(samples), pairs, identical, used) for c in range(len(self.rubric.criteria))
        ]
        total = self.rubric.total_weight()
        scores = [
            sum(c.weight * rates[s] for c, rates in zip(self.rubric.criteria, per_criterion)) / total
            for s in range(len(samples))
        ]
        metrics = self._metrics(samples, scores, per_criterion, pairs, identical, used)
        metrics.update(self.calls.counts(list(used.values()), fresh, len(used)))
        metrics["reward/judge/pairwise/unpaired"] = float(unpaired)
        metrics[TIME] = time.perf_counter() - start
        return scores, metrics

    def _pairs(
        self, samples: list[RewardInput], groups: list[int]
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
        """The pairs of samples to ask about, the pairs of identical responses (ties without a call), and the
        number of samples alone in their group."""
        members: dict[int, list[int]] = {}
        for index, group in enumerate(groups):
            members.setdefault(group, []).append(index)
        pairs, identical = [], []
        for group in members.values():
            for p, q in ring_pairs(len(group), self.opponents):
                i, j = group[p], group[q]
                (identical if samples[i].response == samples[j].response else pairs).append((i, j))
        return pairs, identical, sum(len(group) == 1 for group in members.values())

    def _render(
        self, criterion: Criterion, context: RewardInput, first: int, second: int, samples: list[RewardInput]
    ) -> list[dict[str, str]]:
        """The messages comparing ``samples[first]`` (shown as A) with ``samples[second]`` (B); the prompt,
        reference and row are ``context``'s (one prompt's group shares them)."""
        a, b = samples[first].response, samples[second].response
        return render_pair(self.rubric, criterion, context.prompt, a, b, context.ground_truth, context.extra)

    @staticmethod
    def _win_rates(
        c: int,
        n: int,
        pairs: list[tuple[int, int]],
        identical: list[tuple[int, int]],
        used: dict[tuple[int, int, int], Verdict],
    ) -> list[float]:
        """Each sample's share of criterion ``c``'s comparisons won (a tie half); TIE with none."""
        won, played = [0.0] * n, [0] * n
        for i, j in identical:  # two comparisons, both ties, without a call
            for s in (i, j):
                won[s] += 2 * TIE
                played[s] += 2
        for i, j in pairs:
            for first, second in ((i, j), (j, i)):
                verdict = used[c, first, second].score
                first_share = TIE if verdict is None else verdict
                won[first] += first_share
                won[second] += 1.0 - first_share
                played[first] += 1
                played[second] += 1
        return [w / p if p else TIE for w, p in zip(won, played)]

    def _metrics(
        self,
        samples: list[RewardInput],
        scores: list[float],
        per_criterion: list[list[float]],
        pairs: list[tuple[int, int]],
        identical: list[tuple[int, int]],
        used: dict[tuple[int, int, int], Verdict],
    ) -> dict[str, float]:
        n = len(samples)
        metrics = {"reward/judge/score_mean": sum(scores) / n if n else 0.0}
        for criterion, rates in zip(self.rubric.criteria, per_criterion):
            metrics[f"reward/judge/criterion/{criterion.name}"] = sum(rates) / n if n else 0.0
        decided = [v.score for v in used.values() if v.score in (0.0, 1.0)]
        inconsistent = 0
        for c in range(len(self.rubric.criteria)):
            for i, j in pairs:
                one, other = used[c, i, j].score, used[c, j, i].score
                inconsistent += one is not None and other is not None and one != 1.0 - other
        metrics.update(
            {
                "reward/judge/pairwise/first_wins": sum(decided) / len(decided) if decided else TIE,
                "reward/judge/pairwise/inconsistent": float(inconsistent),
                "reward/judge/pairwise/identical": float(len(identical)),
                "reward/judge/suspicious": float(sum(suspicious(s.response) for s in samples)),
            }
        )
        return metrics
