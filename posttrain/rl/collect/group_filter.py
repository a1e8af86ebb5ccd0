"""Dynamic sampling (DAPO's group filtering; verl's `algorithm.filter_groups`).

A prompt whose samples all get the same value of the filter's metric (all right, or all wrong) gives every sample
a GRPO advantage of 0: it costs a forward and backward pass and teaches nothing. With the filter on, a step draws
generation batches of data.train_batch_size prompts, drops such groups, and keeps drawing until at least
data.train_batch_size groups are left (or algorithm.filter_groups.max_num_gen_batches batches are used up: an
error); the first data.train_batch_size kept groups, in the order they were drawn, are the step's batch.

Each generation batch takes the next prompts from the run's sampler (whose state the checkpoint holds) and its own
seed (``generation_salt``), so a resumed run draws exactly what the uninterrupted run drew. With several data
shares (rank-local data, `posttrain.parallel.shares`) each generation batch's scored samples are gathered (pickled;
only with the filter on), every rank filters the whole batch alike, and the rollout phase then keeps its share of
the kept groups. Without the filter nothing is gathered: each rank keeps the samples of its share.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.data.datasets import TokenizedPrompts
from posttrain.data.sampler import PromptSampler
from posttrain.parallel.runtime import DistContext
from posttrain.parallel.shares import MAX, SINGLE_SHARE, DataShare, ShareMetrics
from posttrain.rewards import counts as reward_counts
from posttrain.rl.collect.generation import Scorer, sample_and_score
from posttrain.rl.collect.multi_turn import AgentLoop
from posttrain.rollout.base import RolloutEngine, RolloutResult, SamplingParams

GEN_BATCH_SALT = 1000  # step_seed salts of the extra generation batches start here (0-2 are taken)
SUMMED_METRICS = (
    "reward/num_failures",
    "reward/num_timeouts",
    "reward/time_s",
    "reward/wait_s",
    *reward_counts.SUMMED,
)  # the others are averaged
UNSHAPED_METRICS = ("acc", "score")  # metrics read before the overlong penalty; the others after it


def generation_salt(k: int) -> int:
    """The `step_seed` salt of a step's k-th generation batch (from 0). The first is the step's plain seed, so
    with the filter on the first batch is the one drawn with it off."""
    return 0 if k == 0 else GEN_BATCH_SALT + k


@dataclass(frozen=True)
class GroupFilter:
    """What a step keeps: groups whose ``metric`` differs; ``num_groups`` of them; at most
    ``max_num_gen_batches`` generation batches (<= 0: no limit)."""

    metric: str
    max_num_gen_batches: int
    num_groups: int


def group_filter(cfg: PostTrainConfig) -> GroupFilter | None:
    """`algorithm.filter_groups`, or None when it is off."""
    f = cfg.algorithm.filter_groups
    if not f.enable:
        return None
    return GroupFilter(f.metric, f.max_num_gen_batches, cfg.data.train_batch_size)


@dataclass
class ScoredGroups:
    """Scored samples of a list of prompts (one group each).

    rows: the record index of each group's prompt, in batch order.
    result: the samples, prompt-major; ``prompt_index`` indexes ``rows``.
    scores: [S] each sample's reward before the overlong penalty; penalties: [S] that penalty (<= 0).
    """

    rows: list[int]
    result: RolloutResult
    scores: torch.Tensor
    penalties: torch.Tensor

    @property
    def rewards(self) -> torch.Tensor:
        """[S] the rewards trained on (overlong penalty included)."""
        return self.scores + self.penalties

    @property
    def num_groups(self) -> int:
        return len(self.rows)

    def select(self, groups: list[int]) -> ScoredGroups:
        """The samples of ``groups`` (indices into ``rows``), in that order, renumbered from 0."""
        position = {g: i for i, g in enumerate(groups)}
        r = self.result
        keep = sorted((position[p], s) for s, p in enumerate(r.prompt_index) if p in position)
        samples = [s for _, s in keep]
        result = r.subset(samples, prompt_index=[i for i, _ in keep])
        idx = torch.tensor(samples, dtype=torch.long)
        return ScoredGroups([self.rows[g] for g in groups], result, self.scores[idx], self.penalties[idx])

    def extend(self, other: ScoredGroups) -> None:
        """Append ``other``'s groups after these."""
        offset, o = len(self.rows), other.result
        self.rows = self.rows + other.rows
        self.result.extend(o.subset(list(range(len(o))), prompt_index=[p + offset for p in o.prompt_index]))
        self.scores = torch.cat([self.scores, other.scores])
        self.penalties = torch.cat([self.penalties, other.penalties])


def score_batch(
    engine: RolloutEngine,
    scorer: Scorer,
    prompts: TokenizedPrompts,
    rows: list[int],
    params: SamplingParams,
    dist: DistContext,
    share: DataShare = SINGLE_SHARE,
    agent: AgentLoop | None = None,
) -> tuple[ScoredGroups, ShareMetrics]:
    """Generate and score this share's part of the prompts ``rows`` (``prompt_index``: the prompt's index in
    ``rows``); the overlong penalty apart. The metrics are this rank's (reduce them with ``share.reduce``)."""
    scored, metrics = sample_and_score(engine, scorer, prompts, rows, params, dist, share, agent)
    return ScoredGroups(list(rows), scored.result, scored.scores, scorer.penalties(scored.result)), metrics


def gather_step(groups: ScoredGroups, dist: DistContext, share: DataShare) -> ScoredGroups:
    """Every share's scored samples of one generation batch, joined in prompt order (shares hold contiguous
    prompts, in share order): what filtering on the whole batch needs. One share: ``groups`` itself."""
    if not share.distributed:
        return groups
    parts = dist.all_gather_object((groups.result, groups.scores, groups.penalties))[:: share.replicas]
    result = RolloutResult()
    for part, _, _ in parts:
        result.extend(part)
    scores = torch.cat([p[1] for p in parts])
    penalties = torch.cat([p[2] for p in parts])
    return ScoredGroups(groups.rows, result, scores, penalties)


def varied_groups(groups: ScoredGroups, metric: str) -> list[int]:
    """The groups whose ``metric`` is not the same for every sample, and groups of a single sample (which have
    nothing to compare; verl keeps them too)."""
    values = groups.scores if metric in UNSHAPED_METRICS else groups.rewards
    members: list[list[float]] = [[] for _ in range(groups.num_groups)]
    for value, p in zip(values.tolist(), groups.result.prompt_index):
        members[p].append(value)
    return [g for g, v in enumerate(members) if len(v) == 1 or (v and max(v) > min(v))]


def draw_groups(
    engine: RolloutEngine,
    scorer: Scorer,
    prompts: TokenizedPrompts,
    sampler: PromptSampler,
    params_for: Callable[[int], SamplingParams],
    flt: GroupFilter | None,
    dist: DistContext,
    share: DataShare = SINGLE_SHARE,
    agent: AgentLoop | None = None,
) -> tuple[ScoredGroups, ShareMetrics]:
    """This step's scored groups: this share's part of one generation batch (no filter), or the whole step of
    kept groups, on every rank, from as many batches as it takes to keep ``flt.num_groups`` groups.
    ``params_for(k)`` is how generation batch k samples (its seed). The metrics are this rank's to reduce
    (with the filter on they are already the step's, the same on every rank)."""
    if flt is None:
        return score_batch(engine, scorer, prompts, sampler.next_batch(), params_for(0), dist, share, agent)
    kept: ScoredGroups | None = None
    per_batch: list[dict[str, float]] = []
    dropped = 0
    for k in itertools.count():
        if 0 < flt.max_num_gen_batches <= k:
            raise _too_few_groups(flt, kept.num_groups, dropped)
        local, metrics = score_batch(
            engine, scorer, prompts, sampler.next_batch(), params_for(k), dist, share, agent
        )
        batch = gather_step(local, dist, share)
        per_batch.append(share.reduce(metrics))
        good = varied_groups(batch, flt.metric)
        dropped += batch.num_groups - len(good)
        if kept is None:
            kept = batch.select(good)
        else:
            kept.extend(batch.select(good))
        if kept.num_groups >= flt.num_groups:
            break
    metrics = merge_batch_metrics(per_batch)
    metrics.update(
        {
            "train/num_gen_batches": float(len(per_batch)),
            "filter_groups/num_kept": float(kept.num_groups),
            "filter_groups/num_dropped": float(dropped),
            "filter_groups/num_surplus": float(kept.num_groups - flt.num_groups),
        }
    )
    step = ShareMetrics()
    step.add(metrics, MAX)  # the same value on every rank: the max over ranks is that value
    return kept.select(list(range(flt.num_groups))), step


def merge_batch_metrics(per_batch: list[dict[str, float]]) -> dict[str, float]:
    """One step's scoring metrics from its generation batches': counts and times summed, the rest averaged."""
    merged: dict[str, float] = {}
    for key in sorted({k for m in per_batch for k in m}):
        values = [m[key] for m in per_batch if key in m]
        merged[key] = float(sum(values)) if key in SUMMED_METRICS else float(sum(values) / len(values))
    return merged


def _too_few_groups(flt: GroupFilter, kept: int, dropped: int) -> ConfigError:
    return ConfigError(
        f"algorithm.filter_groups.max_num_gen_batches={flt.max_num_gen_batches}: that many generation batches "
        f"of data.train_batch_size={flt.num_groups} prompts kept only {kept} of the {flt.num_groups} prompt groups a "
        f"step needs: {dropped} groups had the same algorithm.filter_groups.metric={flt.metric} for every "
        "sample (the prompts are too easy or too hard for the model). Raise "
        "algorithm.filter_groups.max_num_gen_batches (0: no limit), use prompts of mixed difficulty, or set "
        "algorithm.filter_groups.enable=false"
    )
