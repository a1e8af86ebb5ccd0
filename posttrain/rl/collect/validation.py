"""Validation (during training) and `posttrain eval` (a model directory or a checkpoint).

A sample counts as correct when its reward is >= 1.0 (the built-in rule rewards give 1.0 for a
right answer and 0.0 otherwise); with rollout.val_n = k > 1, pass@k is the share of prompts with at
least one correct sample.
"""

from __future__ import annotations

import torch

from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.data.datasets import TokenizedPrompts
from posttrain.parallel.runtime import DistContext, shard_bounds
from posttrain.rewards.runner import RewardInput, RewardRunner
from posttrain.rollout.base import RolloutEngine, SamplingParams

CORRECT_THRESHOLD = 1.0


def validation_params(cfg: PostTrainConfig, seed: int) -> SamplingParams:
    r = cfg.rollout
    if r.val_greedy and r.val_n > 1:
        raise ConfigError(
            f"rollout.val_n={r.val_n} samples per prompt with rollout.val_greedy=true would repeat one answer; "
            "set rollout.val_greedy=false to sample, or rollout.val_n=1"
        )
    return SamplingParams(
        max_tokens=cfg.data.max_response_length,
        n=r.val_n,
        greedy=r.val_greedy,
        temperature=r.temperature if r.temperature > 0 else 1.0,
        top_p=r.top_p,
        top_k=r.top_k,
        seed=seed,
    )


def validate(
    engine: RolloutEngine,
    tokenizer,
    prompts: TokenizedPrompts,
    runner: RewardRunner,
    cfg: PostTrainConfig,
    seed: int = 0,
    dist: DistContext | None = None,
    samples: list[dict] | None = None,
) -> dict[str, float]:
    """Generate for every validation prompt (in batches of data.val_batch_size) and score it.

    With several ranks each validates a contiguous share of the prompts and the results are gathered.
    ``samples``, when given, receives one dict per sample of this rank's share (prompt, response,
    ground_truth, reward), for the sample logs of posttrain.rl.collect.samples.
    """
    params = validation_params(cfg, seed)
    rewards: list[float] = []
    lengths: list[int] = []
    bs = cfg.data.val_batch_size
    rank, world = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    lo, hi = shard_bounds(len(prompts.prompt_ids), rank, world)
    for start in range(lo, hi, bs):
        ids = prompts.prompt_ids[start : min(start + bs, hi)]
        recs = prompts.records[start : min(start + bs, hi)]
        result = engine.generate(ids, params, **({"prompt_offset": start} if world > 1 else {}))
        texts = tokenizer.batch_decode(result.response_ids, skip_special_tokens=True)
        inputs = [
            RewardInput(recs[p].prompt, text, recs[p].ground_truth, recs[p].extra)
            for p, text in zip(result.prompt_index, texts)
        ]
        scores, _ = runner.score(inputs)
        if samples is not None:
            samples.extend(
                {"prompt": i.prompt, "response": i.response, "ground_truth": i.ground_truth, "reward": s}
                for i, s in zip(inputs, scores)
            )
        rewards.extend(scores)
        lengths.extend(len(r) for r in result.response_ids)
    if world > 1:
        shares = dist.all_gather_object((rewards, lengths))
        rewards = [r for share, _ in shares for r in share]
        lengths = [n for _, share in shares for n in share]
    k = params.n
    correct = torch.tensor(rewards) >= CORRECT_THRESHOLD
    out = {
        "val/accuracy": float(correct.float().mean()),
        "val/reward_mean": float(torch.tensor(rewards).mean()),
        "val/response_length_mean": float(torch.tensor(lengths, dtype=torch.float).mean()),
    }
    if k > 1:
        out[f"val/pass@{k}"] = float(correct.view(-1, k).any(-1).float().mean())
    return out
