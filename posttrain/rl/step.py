"""One RL training step, phase by phase:

prompts → rollout → rewards → old log-probs → ref log-probs → values → advantages →
critic update → actor update → (rollout weights are current: the engine shares the actor) → metrics.
"""

from __future__ import annotations

import torch

from posttrain.algorithms.advantages import get_advantage_estimator
from posttrain.algorithms.kl import apply_kl_penalty
from posttrain.config.errors import ConfigError
from posttrain.config.plan import ForwardPlan
from posttrain.data.batch import RolloutBatch, build_rollout_batch
from posttrain.forward.passes import critic_values, policy_logprobs
from posttrain.models.lora import policy_weights
from posttrain.parallel.runtime import shard_bounds
from posttrain.rewards.runner import RewardInput
from posttrain.rl.build import Components
from posttrain.rl.evaluate import CORRECT_THRESHOLD
from posttrain.rollout.base import RolloutResult, SamplingParams
from posttrain.train.losses import actor_loss_fn, critic_loss_fn
from posttrain.train.update import forward_in_micro_batches, run_update
from posttrain.utils.metrics import PhaseTimer


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """A per-step seed: a resumed run draws exactly what the uninterrupted run drew."""
    return (seed * 1_000_003 + step * 7919 + salt) % (2**31 - 1)


def _budget(plan: ForwardPlan) -> int | None:
    return plan.max_token_len_per_rank if plan.use_dynamic_bsz else None


def score_samples(c: Components, prompt_rows: list[int], result: RolloutResult) -> tuple[torch.Tensor, dict]:
    """Rule/user reward (+ reward-model score when enabled) per sample, with failure metrics."""
    records = c.train_prompts.records
    texts = c.tokenizer.batch_decode(result.response_ids, skip_special_tokens=True)
    inputs = [
        RewardInput(
            records[prompt_rows[p]].prompt,
            t,
            records[prompt_rows[p]].ground_truth,
            records[prompt_rows[p]].extra,
        )
        for p, t in zip(result.prompt_index, texts)
    ]
    rewards, metrics = c.reward_runner.score(inputs)
    scores = torch.tensor(rewards, dtype=torch.float32)
    if c.reward_model is not None:
        rm = torch.tensor(c.reward_model.score([i.prompt for i in inputs], texts), dtype=torch.float32)
        metrics["reward/model_score_mean"] = float(rm.mean())
        scores = scores + rm
    return scores, metrics


def place_scores(batch: RolloutBatch, scores: torch.Tensor) -> torch.Tensor:
    """[B, R] token-level scores: each sample's reward on its last response token."""
    out = torch.zeros_like(batch.response_mask)
    last = (batch.response_mask.sum(-1).long() - 1).clamp(min=0)
    out[torch.arange(batch.num_rows), last] = scores
    return out * batch.response_mask


def generate_share(
    c: Components, prompt_rows: list[int], params: SamplingParams
) -> tuple[int, RolloutResult]:
    """This rank's contiguous share of the prompts, generated; returns (offset of the share, result).

    Sample randomness depends on the global sample index (``prompt_offset``), so the samples are the same
    whatever the number of ranks.
    """
    lo, hi = shard_bounds(len(prompt_rows), c.dist.rank, c.dist.world_size)
    ids = [c.train_prompts.prompt_ids[i] for i in prompt_rows[lo:hi]]
    if not ids:
        return lo, RolloutResult()
    extra = {"prompt_offset": lo} if c.dist.distributed else {}
    return lo, c.engine.generate(ids, params, **extra)


def gather_scored(
    c: Components, lo: int, result: RolloutResult, scores: torch.Tensor, metrics: dict[str, float]
) -> tuple[RolloutResult, torch.Tensor, dict[str, float]]:
    """Every rank's scored share joined in prompt order (prompt_index global); metrics weighted by samples."""
    if not c.dist.distributed:
        return result, scores, metrics
    merged, all_scores, weighted, total = RolloutResult(), [], {}, 0
    for r_lo, r_result, r_scores, r_metrics in c.dist.all_gather_object((lo, result, scores, metrics)):
        r_result.prompt_index = [p + r_lo for p in r_result.prompt_index]
        merged.extend(r_result)
        all_scores.append(r_scores)
        total += len(r_result)
        for k, v in r_metrics.items():
            weighted[k] = weighted.get(k, 0.0) + float(v) * len(r_result)
    return merged, torch.cat(all_scores), {k: v / max(total, 1) for k, v in weighted.items()}


def score_share(
    c: Components, prompt_rows: list[int], lo: int, result: RolloutResult
) -> tuple[torch.Tensor, dict]:
    if len(result) == 0:
        return torch.zeros(0), {}
    return score_samples(c, prompt_rows[lo:], result)


def remax_baselines(c: Components, prompt_rows: list[int], group_ids: torch.Tensor) -> torch.Tensor:
    """ReMax's baseline: the reward of a greedy response to the same prompt."""
    params = SamplingParams(max_tokens=c.cfg.data.max_response_length, n=1, greedy=True)
    lo, greedy = generate_share(c, prompt_rows, params)
    scores, _ = score_share(c, prompt_rows, lo, greedy)
    _, scores, _ = gather_scored(c, lo, greedy, scores, {})
    return scores[group_ids]


def rollout_metrics(result: RolloutResult, scores: torch.Tensor) -> dict[str, float]:
    lengths = torch.tensor([len(r) for r in result.response_ids], dtype=torch.float32)
    eos = sum(f == "eos" for f in result.finish_reasons) / max(1, len(result.finish_reasons))
    return {
        "reward/mean": float(scores.mean()),
        "reward/accuracy": float((scores >= CORRECT_THRESHOLD).float().mean()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "finish/eos": eos,
        "finish/length": 1.0 - eos,
    }


def rollout_log_probs(result: RolloutResult, batch: RolloutBatch) -> torch.Tensor:
    """[B, R] the engine's log-prob of each sampled token (0 past a response), rows in ``result`` order.

    This is what ``algorithm.rollout_correction.bypass_mode`` uses as the old log-probs.
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


def fill_forward_passes(
    c: Components, batch: RolloutBatch, timer: PhaseTimer, temperature: float, result: RolloutResult
) -> None:
    """Old log-probs (recomputed, or the rollout's in bypass mode), reference log-probs and values, each in its
    planned forward-only micro-batches."""
    plan, policy, opts = c.plan, c.actor.module, c.forward
    with timer.phase("old_log_prob"):
        if c.cfg.algorithm.rollout_correction.bypass_mode:
            # The engine sampled with the actor's current weights: its log-probs are the old policy's.
            batch.old_log_probs = rollout_log_probs(result, batch).to(batch.response_mask.device)
        else:
            policy.eval()
            batch.old_log_probs = forward_in_micro_batches(
                lambda mb: policy_logprobs(policy, mb, temperature=temperature, options=opts.old_log_prob)[0],
                batch,
                plan.old_log_prob.micro_batch_size_per_rank,
                _budget(plan.old_log_prob),
                c.device,
                c.dp("old_log_prob"),
            )
    if c.ref is not None:
        with timer.phase("ref"):
            batch.ref_log_probs = forward_in_micro_batches(
                lambda mb: policy_logprobs(c.ref, mb, temperature=temperature, options=opts.ref)[0],
                batch,
                plan.ref.micro_batch_size_per_rank,
                _budget(plan.ref),
                c.device,
                c.dp("ref"),
            )
    if c.critic is not None:
        with timer.phase("values"):
            c.critic.module.eval()
            batch.values = forward_in_micro_batches(
                lambda mb: critic_values(c.critic.module, mb, opts.critic),
                batch,
                plan.values.micro_batch_size_per_rank,
                _budget(plan.values),
                c.device,
                c.dp("values"),
            )


def compute_advantages(c: Components, batch: RolloutBatch) -> dict[str, float]:
    """Token rewards (minus the in-reward KL penalty when on), then the configured estimator's advantages."""
    cfg = c.cfg
    metrics: dict[str, float] = {}
    if c.kl_ctrl is not None:
        batch.token_level_rewards, kl_metrics = apply_kl_penalty(
            batch.token_level_scores,
            batch.old_log_probs,
            batch.ref_log_probs,
            batch.response_mask,
            c.kl_ctrl,
            cfg.algorithm.kl_penalty,
        )
        c.kl_ctrl.update(kl_metrics["actor/reward_kl_penalty"], n_steps=batch.num_rows)
        metrics.update(kl_metrics)
    else:
        batch.token_level_rewards = batch.token_level_scores
    alg = cfg.algorithm
    batch.advantages, batch.returns = get_advantage_estimator(alg.adv_estimator)(
        token_level_rewards=batch.token_level_rewards,
        response_mask=batch.response_mask,
        group_ids=batch.group_ids,
        values=batch.values,
        reward_baselines=batch.reward_baselines,
        gamma=alg.gamma,
        lam=alg.lam,
        norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
    )
    return metrics


def train_step(c: Components, step: int, timer: PhaseTimer) -> dict[str, float]:
    """Run one step (1-based `step`) and return its metrics."""
    cfg, plan = c.cfg, c.plan
    prompt_rows = c.sampler.next_batch()
    prompt_ids = [c.train_prompts.prompt_ids[i] for i in prompt_rows]
    r = cfg.rollout
    with timer.phase("rollout"):
        params = SamplingParams(
            max_tokens=cfg.data.max_response_length,
            n=r.n,
            temperature=r.temperature if r.temperature > 0 else 1.0,
            top_p=r.top_p,
            top_k=r.top_k,
            greedy=r.temperature == 0,
            seed=step_seed(cfg.trainer.seed, step),
        )
        lo, local = generate_share(c, prompt_rows, params)
    with timer.phase("reward"):
        # Each rank scores its own share; then every rank holds the whole step (groups intact).
        local_scores, local_metrics = score_share(c, prompt_rows, lo, local)
        result, scores, metrics = gather_scored(c, lo, local, local_scores, local_metrics)
        batch = build_rollout_batch(
            [prompt_ids[p] for p in result.prompt_index],
            result.response_ids,
            result.prompt_index,
            c.tokenizer.pad_token_id,
        )
        batch.token_level_scores = place_scores(batch, scores)
        if cfg.algorithm.adv_estimator == "remax":
            batch.reward_baselines = remax_baselines(c, prompt_rows, batch.group_ids)
    metrics.update(rollout_metrics(result, scores))
    policy, opts = c.actor.module, c.forward
    temperature = r.temperature if r.temperature > 0 else 1.0
    fill_forward_passes(c, batch, timer, temperature, result)
    with timer.phase("advantage"):
        metrics.update(compute_advantages(c, batch))
    norm_constant = float(cfg.data.max_response_length)
    gen = torch.Generator().manual_seed(step_seed(cfg.trainer.seed, step, salt=1))
    if c.critic is not None:
        with timer.phase("update_critic"):
            metrics.update(
                run_update(
                    c.critic,
                    batch,
                    plan.critic,
                    critic_loss_fn(c.critic.module, cfg.critic, opts.critic),
                    shuffle=cfg.critic.shuffle,
                    norm_constant=norm_constant,
                    generator=gen,
                    prefix="critic",
                    dp=c.dp("critic"),
                )
            )
    if step > cfg.critic.warmup_steps or c.critic is None:
        with timer.phase("update_actor"):
            metrics.update(
                run_update(
                    c.actor,
                    batch,
                    plan.actor,
                    actor_loss_fn(policy, cfg.actor, temperature, opts.actor),
                    shuffle=cfg.actor.shuffle,
                    norm_constant=norm_constant,
                    generator=gen,
                    prefix="actor",
                    dp=c.dp("actor"),
                )
            )
    # On one rank the native engine shares the actor's module, so this refresh is free; a sharded actor is
    # gathered (a collective: every rank calls it) into the engine's own copy.
    with timer.phase("sync_weights"):
        if c.engine.model is not policy:
            c.engine.sync_weights(policy_weights(policy))  # Hugging Face names; LoRA adapters merged
    tokens = float(batch.attention_mask.sum())
    metrics.update(timer.pop())
    step_time = sum(v for k, v in metrics.items() if k.startswith("timing/"))
    metrics["timing/step"] = step_time
    metrics["perf/tokens_per_s"] = tokens / max(step_time, 1e-9)
    return metrics
