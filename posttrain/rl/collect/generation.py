"""The rollout and reward phases of a step: generate this rank's part of the prompts, score it, and keep this
rank's share of the step (rank-local data: whole prompt groups; `posttrain.parallel.shares`).

Each function takes what it uses (the engine, the prompts, the scorer, the process group), not the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.data.batch import RolloutBatch, build_rollout_batch
from posttrain.data.datasets import TokenizedPrompts
from posttrain.parallel.runtime import DistContext, shard_bounds
from posttrain.parallel.shares import MAX, MEAN, SINGLE_SHARE, SUM, DataShare, ShareMetrics
from posttrain.rewards import counts as reward_counts
from posttrain.rewards import judge as judge_metrics
from posttrain.rewards.background import WAIT_METRIC, BackgroundScoring
from posttrain.rewards.combine import RewardWeights, combine_rewards
from posttrain.rewards.judge import JudgeScorer, PairwiseJudgeScorer
from posttrain.rewards.overlong import OverlongBuffer
from posttrain.rewards.process_reward import ProcessReward, dense_shift
from posttrain.rewards.reward_model import RewardModelScorer
from posttrain.rewards.runner import RewardRunner
from posttrain.rl.collect.multi_turn import AgentLoop, env_rewards, score_weights
from posttrain.rl.collect.validation import CORRECT_THRESHOLD, reward_inputs
from posttrain.rollout.base import (
    RolloutEngine,
    RolloutResult,
    SampleCallback,
    SamplingParams,
    generate_reporting,
)


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """A per-step seed: a resumed run draws exactly what the uninterrupted run drew."""
    return (seed * 1_000_003 + step * 7919 + salt) % (2**31 - 1)


def training_params(cfg: PostTrainConfig, seed: int) -> SamplingParams:
    """How the training rollout samples (`rollout.*`); temperature 0 means greedy."""
    r = cfg.rollout
    return SamplingParams(
        max_tokens=cfg.data.max_response_length,
        n=r.n,
        temperature=r.temperature if r.temperature > 0 else 1.0,
        top_p=r.top_p,
        top_k=r.top_k,
        greedy=r.temperature == 0,
        seed=seed,
    )


def overlong_shaping(cfg: PostTrainConfig) -> OverlongBuffer | None:
    """DAPO's overlong reward shaping (`reward.overlong_buffer.*`), or None when it is off."""
    o = cfg.reward.overlong_buffer
    if not o.enable:
        return None
    return OverlongBuffer(cfg.data.max_response_length, o.len, o.penalty_factor)


@dataclass(frozen=True)
class Scorer:
    """Turns responses into rewards: the rule or user function (behind its runner's guards), plus the reward
    model's and the judge's scores when they are enabled. The overlong penalty (``overlong``) is separate: it depends on lengths
    only, so callers add :meth:`penalties` to the scores. ``during_generation``: the runner scores each sample
    as the engine finishes it (:mod:`posttrain.rewards.background`; ``reward.score_during_generation``)."""

    runner: RewardRunner
    reward_model: RewardModelScorer | None
    tokenizer: object
    overlong: OverlongBuffer | None = None
    weights: RewardWeights = RewardWeights()
    during_generation: bool = False
    judge: JudgeScorer | PairwiseJudgeScorer | None = None
    prm: ProcessReward | None = None
    judge_during_generation: bool = False  # ask the judge about each sample as the engine finishes it

    def penalties(self, result: RolloutResult) -> torch.Tensor:
        """[S] the overlong penalty of each of ``result``'s samples (zeros when the shaping is off)."""
        if self.overlong is None:
            return torch.zeros(len(result))
        return self.overlong.penalties(result.response_lengths)

    @property
    def scores_during_generation(self) -> bool:
        """Whether anything is scored as the engine finishes each sample (the rule, or the judge's calls)."""
        return self.during_generation or self.judge_during_generation

    def feeder(
        self, prompts: TokenizedPrompts, rows: list[int], background: BackgroundScoring | None
    ) -> SampleCallback:
        """The engine's ``on_sample`` that hands each finished sample's reward input to ``background`` (the
        rule's scoring thread) and, with ``judge_during_generation``, to the judge."""

        def on_sample(index: int, sample: RolloutResult) -> None:
            record = prompts.records[rows[sample.prompt_index[0]]]
            item = reward_inputs([record], sample, self.tokenizer)[0]
            if background is not None:
                background.add(index, item)
            if self.judge_during_generation:
                self.judge.prefetch(item)

        return on_sample

    def score(
        self,
        prompts: TokenizedPrompts,
        rows: list[int],
        result: RolloutResult,
        background: BackgroundScoring | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """[S] rewards of ``result``'s samples; ``rows[p]`` is the record of the call's prompt p. The metrics have
        the same names with no sample (their values are then weightless zeros): ranks reduce them together.
        ``background``: the samples were fed to it during generation (:meth:`feeder`); their rewards come from it."""
        inputs = None  # decoded once, and only where needed: the feeder decoded the background's samples
        if background is not None:  # first: the thread ends here whatever happens next
            rewards, metrics = background.finish(len(result))
        records = [prompts.records[rows[p]] for p in result.prompt_index]
        if background is None:
            inputs = reward_inputs(records, result, self.tokenizer)
            rewards, metrics = self.runner.score(inputs)
            metrics[WAIT_METRIC] = metrics["reward/time_s"]  # all of it after generation
        rm = None  # the reward model's scores; combined with the rule by posttrain.rewards.combine
        if self.reward_model is not None:
            inputs = reward_inputs(records, result, self.tokenizer) if inputs is None else inputs
            texts = [i.response for i in inputs]
            rm = torch.tensor(self.reward_model.score([i.prompt for i in inputs], texts) if inputs else [])
        judged = None  # the judge's scores, in [0, 1]
        if self.judge is not None:
            inputs = reward_inputs(records, result, self.tokenizer) if inputs is None else inputs
            # the groups: a pairwise judge compares the samples of one prompt only
            judge_scores, judge_parts = self.judge.score(inputs, list(result.prompt_index))
            judged = torch.tensor(judge_scores, dtype=torch.float32)
            metrics = {**metrics, **judge_parts}
        weights = torch.tensor(score_weights(result), dtype=torch.float32)
        prm = None  # the process reward model's part (its step scores' sum when they are placed densely)
        if self.prm is not None:
            prm, placed, prm_metrics = self.prm.score(
                [r.prompt for r in records], result.response_ids, result.masks(), self.tokenizer
            )
            metrics = {**metrics, **prm_metrics}
            if placed is not None:  # weighed like the rest of the score (a harness's weight 0 drops it)
                w = self.weights.prm
                result.dense_rewards = [
                    [(i, w * float(k) * v) for i, v in pairs] for pairs, k in zip(placed, weights)
                ]
        rule = torch.tensor(rewards, dtype=torch.float32)
        scores, parts = combine_rewards(rule, rm, self.weights, judged, prm)
        # Multi-turn: the environment's reward adds to the score, or replaces it (a harness's reward).
        scores = scores * weights + torch.tensor(env_rewards(result), dtype=torch.float32)
        return scores, {**metrics, **parts}


def generate_share(
    engine: RolloutEngine,
    prompts: TokenizedPrompts,
    prompt_rows: list[int],
    params: SamplingParams,
    dist: DistContext,
    agent: AgentLoop | None = None,
    on_sample: SampleCallback | None = None,
) -> tuple[int, RolloutResult]:
    """This rank's contiguous part of the prompts (1/world of them), generated; returns (offset of the part,
    result). The parts of the ranks that hold one data share make up the share (:func:`join_replicas`).
    ``on_sample`` gets each sample of the part as it finishes (``RolloutEngine.generate``).

    Sample randomness depends on the global sample index (``prompt_offset``), so the samples are the same
    whatever the number of ranks. With ``agent`` each sample is a multi-turn trajectory (its samples carry their
    own prompts and episodes).
    """
    lo, hi = shard_bounds(len(prompt_rows), dist.rank, dist.world_size)
    ids = [prompts.prompt_ids[i] for i in prompt_rows[lo:hi]]
    if not ids:
        return lo, RolloutResult()
    if agent is not None:
        records = [prompts.records[i] for i in prompt_rows[lo:hi]]
        rows = list(prompt_rows[lo:hi])
        return lo, agent.generate(engine, records, params, lo, row_ids=rows, on_sample=on_sample)
    extra = {"prompt_offset": lo} if dist.distributed else {}
    return lo, generate_reporting(engine, ids, params, on_sample, **extra)


@dataclass
class Scored:
    """Samples with their rewards: ``result`` (prompt-major; ``prompt_index``: the prompt's index in the step) and
    ``scores`` [S]."""

    result: RolloutResult
    scores: torch.Tensor


# How the scorer's metrics combine over ranks (each rank's own samples); every other one is a mean over samples.
SCORER_REDUCTIONS = {
    "reward/num_failures": SUM,
    "reward/num_timeouts": SUM,
    "reward/time_s": MAX,
    WAIT_METRIC: MAX,
}
SCORER_REDUCTIONS.update(dict.fromkeys(reward_counts.SUMMED, SUM))  # the code reward's counts
SCORER_REDUCTIONS.update(dict.fromkeys(judge_metrics.SUMMED, SUM))  # the judge's counts
SCORER_REDUCTIONS[judge_metrics.TIME] = MAX
SCORER_REDUCTIONS.update(dict.fromkeys(("reward/prm/no_steps", "reward/prm/cut_steps"), SUM))


def join_replicas(share: DataShare, lo: int, result: RolloutResult, scores: torch.Tensor) -> Scored:
    """This rank's scored part (its first prompt at ``lo`` in the step) joined with the other parts of its
    share: the ranks that hold one share (an SP group) generate a part each and join them (pickled, within the
    share only). One rank per share: its part is the share."""
    result.prompt_index = [p + lo for p in result.prompt_index]
    if share.replicas == 1:
        return Scored(result, scores)
    merged, all_scores = RolloutResult(), []
    for part, part_scores in share.gather_replicas((result, scores)):
        merged.extend(part)
        all_scores.append(part_scores)
    return Scored(merged, torch.cat(all_scores))


def sample_and_score(
    engine: RolloutEngine,
    scorer: Scorer,
    prompts: TokenizedPrompts,
    prompt_rows: list[int],
    params: SamplingParams,
    dist: DistContext,
    share: DataShare = SINGLE_SHARE,
    agent: AgentLoop | None = None,
) -> tuple[Scored, ShareMetrics]:
    """Generate and score this rank's part of the prompts, then keep its share of the step (prompt-major,
    ``prompt_index``: the prompt's index in the step). Nothing crosses shares; the scorer's metrics are this
    rank's (reduce them with ``share.reduce``). ``agent``: roll out multi-turn trajectories. With
    ``scorer.during_generation`` each sample is scored as it finishes, beside the generation of the others; with
    ``scorer.judge_during_generation`` the judge is asked about it then."""
    if not scorer.scores_during_generation:
        lo, local = generate_share(engine, prompts, prompt_rows, params, dist, agent)
        return score_share(scorer, prompts, prompt_rows, lo, local, share)
    lo, _ = shard_bounds(len(prompt_rows), dist.rank, dist.world_size)
    background = BackgroundScoring(scorer.runner) if scorer.during_generation else None
    try:
        on_sample = scorer.feeder(prompts, prompt_rows[lo:], background)
        lo, local = generate_share(engine, prompts, prompt_rows, params, dist, agent, on_sample)
    except BaseException:
        if background is not None:
            background.cancel()  # the runner is free again before the error goes up
        if scorer.judge_during_generation:
            scorer.judge.cancel_prefetch()
        raise
    return score_share(scorer, prompts, prompt_rows, lo, local, share, background)


def score_share(
    scorer: Scorer,
    prompts: TokenizedPrompts,
    prompt_rows: list[int],
    lo: int,
    local: RolloutResult,
    share: DataShare = SINGLE_SHARE,
    background: BackgroundScoring | None = None,
) -> tuple[Scored, ShareMetrics]:
    """Score this rank's generated part ``local`` of the prompts (its first prompt at ``lo`` in the step), then
    keep its share of the step; the scorer's metrics are this rank's (reduce them with ``share.reduce``).
    ``background``: ``local``'s samples were fed to it as they finished."""
    scores, scorer_metrics = scorer.score(prompts, prompt_rows[lo:], local, background)
    metrics = ShareMetrics()
    for name, value in scorer_metrics.items():
        metrics.add({name: value}, SCORER_REDUCTIONS.get(name, MEAN), weight=len(local), own=True)
    return join_replicas(share, lo, local, scores), metrics


def greedy_baselines(
    engine: RolloutEngine,
    scorer: Scorer,
    prompts: TokenizedPrompts,
    prompt_rows: list[int],
    max_tokens: int,
    dist: DistContext,
    share: DataShare = SINGLE_SHARE,
) -> torch.Tensor:
    """[P] the reward of one greedy response per prompt of the step (ReMax's baseline), overlong penalty
    included; only this share's prompts are generated, other entries are 0."""
    params = SamplingParams(max_tokens=max_tokens, n=1, greedy=True)
    scored, _ = sample_and_score(engine, scorer, prompts, prompt_rows, params, dist, share)
    out = torch.zeros(len(prompt_rows), dtype=scored.scores.dtype)
    rewards = scored.scores + scorer.penalties(scored.result)
    out[torch.as_tensor(scored.result.prompt_index, dtype=torch.long)] = rewards
    return out


def scored_batch(
    scored: Scored,
    prompt_ids: list[list[int]],
    pad_token_id: int,
    baselines: torch.Tensor | None,
    with_rollout_log_probs: bool,
    turn_rewards: str = "final",
) -> RolloutBatch:
    """The batch of ``scored`` samples (``prompt_ids``: the step's prompts, by index): rows in sample order,
    group ids the prompts' indices in the step, scores on the last response token, ReMax baselines and the
    engine's log-probs when asked for. ``scored`` is this rank's share, or a whole step gathered (to filter
    groups, say), which `posttrain.parallel.shares.select_share` then cuts to the share. Multi-turn samples bring
    their own prompts; with ``turn_rewards="per_turn"`` the environment's reward of each turn sits on the last
    token of that assistant turn (the rest of the reward on the last trained token)."""
    result = scored.result
    batch = build_rollout_batch(
        result.prompt_ids or [prompt_ids[p] for p in result.prompt_index],
        result.response_ids,
        result.prompt_index,
        pad_token_id,
        result.trainable_mask,
    )
    batch.token_level_scores = place_scores(batch, scored.scores)
    if result.dense_rewards is not None:  # a PRM's step scores: from the last token to each step's end
        width = batch.response_mask.shape[1]
        last = width - 1 - batch.response_mask.flip(-1).argmax(-1)
        batch.token_level_scores += dense_shift(result.dense_rewards, last, width).to(
            batch.token_level_scores
        )
    if turn_rewards == "per_turn" and result.episodes is not None:
        batch.token_level_scores += per_turn_shift(result.episodes, batch.response_mask.shape[1])
    if baselines is not None:
        batch.reward_baselines = baselines[batch.group_ids]
    if with_rollout_log_probs:
        batch.rollout_log_probs = rollout_log_probs(result, batch)
    return batch


def place_scores(batch: RolloutBatch, scores: torch.Tensor) -> torch.Tensor:
    """[B, R] token-level scores: each sample's reward on its last trained response token."""
    out = torch.zeros_like(batch.response_mask)
    width = batch.response_mask.shape[1]
    last = width - 1 - batch.response_mask.flip(-1).argmax(-1)  # single-turn: the response's last token
    out[torch.arange(batch.num_rows), last] = scores
    return out * batch.response_mask


def per_turn_shift(episodes: list, width: int) -> torch.Tensor:
    """[B, width] what moves each turn's environment reward from the last trained token (where
    :func:`place_scores` put the whole reward) to the last token of its own assistant turn
    (``Trajectory.turn_end_rewards``, the one placement of per-turn rewards)."""
    out = torch.zeros(len(episodes), width)
    for i, episode in enumerate(episodes):
        ends = [end - 1 for start, end in episode.turns if end > start]
        if not ends:
            continue
        placed = episode.turn_end_rewards()
        out[i, : len(placed)] = torch.tensor(placed)
        out[i, ends[-1]] -= sum(placed)
    return out


def rollout_metrics(
    result: RolloutResult,
    rewards: torch.Tensor,
    metrics: ShareMetrics,
    unshaped: torch.Tensor | None = None,
    accuracy: bool = True,
) -> None:
    """Add the samples' reward, accuracy, length and finish metrics to ``metrics`` (means over samples).
    ``rewards`` are the rewards trained on; accuracy reads ``unshaped`` (before the overlong penalty) if given.
    ``accuracy=False`` (a reward model's score is summed in, so no threshold on the sum means "right"): no
    ``reward/accuracy``; ``reward/rule_accuracy`` (posttrain.rewards.combine) is the share the rule marks right."""
    lengths = torch.tensor([len(r) for r in result.response_ids], dtype=torch.float32)
    eos = sum(f == "eos" for f in result.finish_reasons) / max(1, len(result.finish_reasons))
    means = {
        "reward/mean": float(rewards.mean()),
        "response_length/mean": float(lengths.mean()),
        "finish/eos": eos,
        "finish/length": 1.0 - eos,
    }
    if accuracy:
        correct = (rewards if unshaped is None else unshaped) >= CORRECT_THRESHOLD
        means["reward/accuracy"] = float(correct.float().mean())
    metrics.add(means, MEAN, weight=len(result))
    metrics.add({"response_length/max": float(lengths.max())}, MAX)


def has_rollout_log_probs(result: RolloutResult) -> bool:
    """Whether the engine reported the log-prob of every sampled token."""
    return all(len(lp) == len(ids) for ids, lp in zip(result.response_ids, result.response_logprobs))


def rollout_log_probs(result: RolloutResult, batch: RolloutBatch) -> torch.Tensor:
    """[B, R] the engine's log-prob of each sampled token (0 past a response), rows in ``result`` order.

    Bypass mode uses them as the old log-probs; the mismatch correction compares them with the trainer's.
    """
    out = torch.zeros_like(batch.response_mask)
    for i, (ids, logprobs) in enumerate(zip(result.response_ids, result.response_logprobs)):
        if len(logprobs) != len(ids):
            raise ConfigError(
                f"algorithm.rollout_correction.bypass_mode=true needs the rollout engine's log-prob of every "
                f"sampled token, but sample {i} has {len(ids)} tokens and {len(logprobs)} log-probs; set "
                "algorithm.rollout_correction.bypass_mode=false to recompute them with the actor"
            )
        out[i, : len(logprobs)] = torch.tensor(logprobs, dtype=out.dtype)
    return out
