"""The rollout and reward phases of a step: generate this rank's share of the prompts, score it, join the shares.

Each function takes what it uses (the engine, the prompts, the scorer, the process group), not the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.data.batch import RolloutBatch
from posttrain.data.datasets import TokenizedPrompts
from posttrain.parallel.runtime import DistContext, shard_bounds
from posttrain.rewards.overlong import OverlongBuffer
from posttrain.rewards.reward_model import RewardModelScorer
from posttrain.rewards.runner import RewardInput, RewardRunner
from posttrain.rl.evaluate import CORRECT_THRESHOLD
from posttrain.rollout.base import RolloutEngine, RolloutResult, SamplingParams


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
    model's score when one is enabled. The overlong penalty (``overlong``) is separate: it depends on lengths
    only, so callers add :meth:`penalties` to the gathered scores."""

    runner: RewardRunner
    reward_model: RewardModelScorer | None
    tokenizer: object
    overlong: OverlongBuffer | None = None

    def penalties(self, result: RolloutResult) -> torch.Tensor:
        """[S] the overlong penalty of each of ``result``'s samples (zeros when the shaping is off)."""
        if self.overlong is None:
            return torch.zeros(len(result))
        return self.overlong.penalties(result.response_lengths)

    def score(
        self, prompts: TokenizedPrompts, rows: list[int], result: RolloutResult
    ) -> tuple[torch.Tensor, dict]:
        """[S] rewards of ``result``'s samples; ``rows[p]`` is the record of the call's prompt p."""
        if len(result) == 0:
            return torch.zeros(0), {}
        texts = self.tokenizer.batch_decode(result.response_ids, skip_special_tokens=True)
        records = [prompts.records[rows[p]] for p in result.prompt_index]
        inputs = [RewardInput(r.prompt, t, r.ground_truth, r.extra) for r, t in zip(records, texts)]
        rewards, metrics = self.runner.score(inputs)
        scores = torch.tensor(rewards, dtype=torch.float32)
        if self.reward_model is not None:
            rm = torch.tensor(self.reward_model.score([i.prompt for i in inputs], texts), dtype=torch.float32)
            metrics["reward/model_score_mean"] = float(rm.mean())
            scores = scores + rm
        return scores, metrics


def generate_share(
    engine: RolloutEngine,
    prompts: TokenizedPrompts,
    prompt_rows: list[int],
    params: SamplingParams,
    dist: DistContext,
) -> tuple[int, RolloutResult]:
    """This rank's contiguous share of the prompts, generated; returns (offset of the share, result).

    Sample randomness depends on the global sample index (``prompt_offset``), so the samples are the same
    whatever the number of ranks.
    """
    lo, hi = shard_bounds(len(prompt_rows), dist.rank, dist.world_size)
    ids = [prompts.prompt_ids[i] for i in prompt_rows[lo:hi]]
    if not ids:
        return lo, RolloutResult()
    extra = {"prompt_offset": lo} if dist.distributed else {}
    return lo, engine.generate(ids, params, **extra)


def gather_scored(
    dist: DistContext, lo: int, result: RolloutResult, scores: torch.Tensor, metrics: dict[str, float]
) -> tuple[RolloutResult, torch.Tensor, dict[str, float]]:
    """Every rank's scored share joined in prompt order (prompt_index global); metrics weighted by samples."""
    if not dist.distributed:
        return result, scores, metrics
    merged, all_scores, weighted, total = RolloutResult(), [], {}, 0
    for r_lo, r_result, r_scores, r_metrics in dist.all_gather_object((lo, result, scores, metrics)):
        r_result.prompt_index = [p + r_lo for p in r_result.prompt_index]
        merged.extend(r_result)
        all_scores.append(r_scores)
        total += len(r_result)
        for k, v in r_metrics.items():
            weighted[k] = weighted.get(k, 0.0) + float(v) * len(r_result)
    return merged, torch.cat(all_scores), {k: v / max(total, 1) for k, v in weighted.items()}


def sample_and_score(
    engine: RolloutEngine,
    scorer: Scorer,
    prompts: TokenizedPrompts,
    prompt_rows: list[int],
    params: SamplingParams,
    dist: DistContext,
) -> tuple[RolloutResult, torch.Tensor, dict[str, float]]:
    """Generate and score this rank's share, then join every rank's (prompt-major, prompt_index global)."""
    lo, local = generate_share(engine, prompts, prompt_rows, params, dist)
    scores, metrics = scorer.score(prompts, prompt_rows[lo:], local)
    return gather_scored(dist, lo, local, scores, metrics)


def greedy_baselines(
    engine: RolloutEngine,
    scorer: Scorer,
    prompts: TokenizedPrompts,
    prompt_rows: list[int],
    max_tokens: int,
    dist: DistContext,
) -> torch.Tensor:
    """[P] the reward of one greedy response per prompt (ReMax's baseline), overlong penalty included."""
    params = SamplingParams(max_tokens=max_tokens, n=1, greedy=True)
    result, scores, _ = sample_and_score(engine, scorer, prompts, prompt_rows, params, dist)
    return scores + scorer.penalties(result)


def place_scores(batch: RolloutBatch, scores: torch.Tensor) -> torch.Tensor:
    """[B, R] token-level scores: each sample's reward on its last response token."""
    out = torch.zeros_like(batch.response_mask)
    last = (batch.response_mask.sum(-1).long() - 1).clamp(min=0)
    out[torch.arange(batch.num_rows), last] = scores
    return out * batch.response_mask


def rollout_metrics(
    result: RolloutResult, scores: torch.Tensor, unshaped: torch.Tensor | None = None
) -> dict[str, float]:
    """The step's reward, accuracy, lengths and finish reasons. ``scores`` are the rewards trained on;
    accuracy reads ``unshaped`` (before the overlong penalty) when given."""
    lengths = torch.tensor([len(r) for r in result.response_ids], dtype=torch.float32)
    eos = sum(f == "eos" for f in result.finish_reasons) / max(1, len(result.finish_reasons))
    correct = (scores if unshaped is None else unshaped) >= CORRECT_THRESHOLD
    return {
        "reward/mean": float(scores.mean()),
        "reward/accuracy": float(correct.float().mean()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "finish/eos": eos,
        "finish/length": 1.0 - eos,
    }


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
