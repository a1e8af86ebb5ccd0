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
from posttrain.data.records import PromptRecord
from posttrain.parallel.runtime import DistContext, shard_bounds
from posttrain.rewards.runner import RewardInput, RewardRunner
from posttrain.rl.collect.multi_turn import AgentLoop, env_rewards, score_weights
from posttrain.rollout.base import RolloutEngine, RolloutResult, SamplingParams

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


def reward_inputs(records: list[PromptRecord], result: RolloutResult, tokenizer) -> list[RewardInput]:
    """What the reward function sees of each sample (``records[s]``: sample s's record). Single-turn: the
    decoded response. Multi-turn: the text of the trajectory's last assistant turn, and in ``extra`` (next to
    the record's own fields) the whole conversation (``messages``), the environment's reward of each assistant
    turn (``turn_rewards``) and their sum (``env_reward``)."""
    if result.episodes is None:
        texts = tokenizer.batch_decode(result.response_ids, skip_special_tokens=True)
        return [RewardInput(r.prompt, t, r.ground_truth, r.extra) for r, t in zip(records, texts)]
    out = []
    for record, episode in zip(records, result.episodes):
        said = [m.get("content", "") for m in episode.messages if m.get("role") == "assistant"]
        extra = {
            **record.extra,
            "messages": episode.messages,
            "turn_rewards": list(episode.turn_rewards),
            "env_reward": episode.reward,
        }
        out.append(RewardInput(record.prompt, said[-1] if said else "", record.ground_truth, extra))
    return out


def validate(
    engine: RolloutEngine,
    tokenizer,
    prompts: TokenizedPrompts,
    runner: RewardRunner,
    cfg: PostTrainConfig,
    seed: int = 0,
    dist: DistContext | None = None,
    samples: list[dict] | None = None,
    agent: AgentLoop | None = None,
) -> dict[str, float]:
    """Generate for every validation prompt (in batches of data.val_batch_size) and score it.

    With several ranks each validates a contiguous share of the prompts and the results are gathered.
    ``samples``, when given, receives one dict per sample of this rank's share (prompt, response,
    ground_truth, reward), for the sample logs of posttrain.rl.collect.samples. With ``agent`` each sample is a
    multi-turn trajectory: its reward adds the environment's, its sample row has the whole conversation
    (``messages``) and its number of turns, and the metrics add turn and tool-call statistics.
    """
    params = validation_params(cfg, seed)
    rewards: list[float] = []
    lengths: list[int] = []
    turns: list[tuple[int, float]] = []  # multi-turn: (turns, tool calls) of each trajectory
    bs = cfg.data.val_batch_size
    rank, world = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    lo, hi = shard_bounds(len(prompts.prompt_ids), rank, world)
    for start in range(lo, hi, bs):
        ids = prompts.prompt_ids[start : min(start + bs, hi)]
        recs = prompts.records[start : min(start + bs, hi)]
        offset = start if world > 1 else 0
        result, inputs, scores = _generate_and_score(
            engine, tokenizer, runner, recs, ids, params, offset, agent
        )
        episodes = result.episodes or [None] * len(inputs)
        if samples is not None:
            samples.extend(sample_row(i, s, e, tokenizer) for i, s, e in zip(inputs, scores, episodes))
        rewards.extend(scores)
        lengths.extend(len(r) for r in result.response_ids)
        turns.extend(episode_counts(e) for e in episodes if e is not None)
    if world > 1:
        shares = dist.all_gather_object((rewards, lengths, turns))
        rewards = [r for share, _, _ in shares for r in share]
        lengths = [n for _, share, _ in shares for n in share]
        turns = [t for _, _, share in shares for t in share]
    k = params.n
    correct = torch.tensor(rewards) >= CORRECT_THRESHOLD
    out = {
        "val/accuracy": float(correct.float().mean()),
        "val/reward_mean": float(torch.tensor(rewards).mean()),
        "val/response_length_mean": float(torch.tensor(lengths, dtype=torch.float).mean()),
    }
    if k > 1:
        out[f"val/pass@{k}"] = float(correct.view(-1, k).any(-1).float().mean())
    if turns:
        out["val/num_turns_mean"] = sum(t for t, _ in turns) / len(turns)
        out["val/tool_call_counts_mean"] = sum(c for _, c in turns) / len(turns)
        out["val/tool_call_frequency"] = sum(1 for _, c in turns if c > 0) / len(turns)
    return out


def _generate_and_score(engine, tokenizer, runner, records, ids, params, offset, agent):
    """(result, reward inputs, rewards) of one validation batch; a trajectory's reward adds the environment's
    (or is it: a harness's reward replaces the reward function's score)."""
    if agent is not None:
        rows = list(range(offset, offset + len(records)))
        result = agent.generate(engine, records, params, offset, row_ids=rows)
    else:
        result = engine.generate(ids, params, **({"prompt_offset": offset} if offset else {}))
    inputs = reward_inputs([records[p] for p in result.prompt_index], result, tokenizer)
    scores, _ = runner.score(inputs)
    weights, env = score_weights(result), env_rewards(result)
    return result, inputs, [s * w + e for s, w, e in zip(scores, weights, env)]


def episode_counts(episode) -> tuple[int, float]:
    """(turns, tool calls) of a trajectory; turns count assistant and environment turns, as in training."""
    return episode.num_assistant_turns + episode.num_user_turns, episode.metrics.get("tool_calls", 0.0)


def sample_row(given: RewardInput, reward: float, episode, tokenizer=None) -> dict:
    """One validation sample for the sample logs and `posttrain eval`; a trajectory adds its conversation and,
    with ``tokenizer``, its response as the loss sees it (``spans``: the trained and masked-out runs)."""
    row = {
        "prompt": given.prompt,
        "response": given.response,
        "ground_truth": given.ground_truth,
        "reward": reward,
    }
    if episode is not None:
        row["messages"] = episode.messages
        row["turns"] = episode.num_assistant_turns + episode.num_user_turns
        row["finish_reason"] = episode.finish_reason
        row["env_reward"] = episode.reward
        if tokenizer is not None:
            row["spans"] = episode.trained_spans(tokenizer)
    return row
