"""Validation (during training) and `posttrain eval` (a model directory or a checkpoint).

A sample counts as correct when its reward is >= 1.0 (the built-in rule rewards give 1.0 for a
right answer and 0.0 otherwise); with rollout.val_n = k > 1, pass@k is the share of prompts with at
least one correct sample.
"""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.config.schema import PostTrainConfig
from posttrain.data.datasets import TokenizedPrompts
from posttrain.distributed.runtime import DistContext, shard_bounds
from posttrain.rewards.runner import RewardInput, RewardRunner
from posttrain.rollout.base import RolloutEngine, SamplingParams

CORRECT_THRESHOLD = 1.0


def validation_params(cfg: PostTrainConfig, seed: int) -> SamplingParams:
    r = cfg.rollout
    if r.val_greedy and r.val_n > 1:
        raise ValueError(
            f"rollout.val_n={r.val_n} samples per prompt with rollout.val_greedy=true would repeat one answer; "
            "set rollout.val_greedy=false to sample, or rollout.val_n=1"
        )
    return SamplingParams(
        max_tokens=cfg.data.max_response_length, n=r.val_n, greedy=r.val_greedy,
        temperature=r.temperature if r.temperature > 0 else 1.0, top_p=r.top_p, top_k=r.top_k, seed=seed,
    )  # fmt: skip


def validate(
    engine: RolloutEngine,
    tokenizer,
    prompts: TokenizedPrompts,
    runner: RewardRunner,
    cfg: PostTrainConfig,
    seed: int = 0,
    dist: DistContext | None = None,
) -> dict[str, float]:
    """Generate for every validation prompt (in batches of data.val_batch_size) and score it.

    With several ranks each validates a contiguous share of the prompts and the results are gathered.
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


def run_eval_command(cfg: PostTrainConfig, model_path: str | None = None) -> dict[str, float]:
    """`posttrain eval`: validation accuracy of a model directory or a training checkpoint."""
    from posttrain.config.load import apply_values
    from posttrain.data.datasets import tokenize_prompts
    from posttrain.models.hf import load_causal_lm, load_tokenizer
    from posttrain.models.lora import apply_lora
    from posttrain.rewards.functions import resolve_reward_function
    from posttrain.rollout.native import NativeEngine
    from posttrain.trainers.common import load_splits, seed_everything, select_device
    from posttrain.trainers.setup import load_checkpoint_policy, resolve_model_path

    device = select_device(cfg)
    seed_everything(cfg.trainer.seed)
    path = Path(model_path) if model_path else None
    if path is not None and not path.exists():
        raise ValueError(f"--model {path} does not exist")
    if path is not None and (path / "config.json").exists():
        tokenizer, model = load_tokenizer(path), load_causal_lm(path, cfg.model.dtype, device)
    else:
        base = resolve_model_path(cfg)
        tokenizer, model = load_tokenizer(base), load_causal_lm(base, cfg.model.dtype, device)
        if path is not None and (path / "adapter_config.json").exists():  # an exported LoRA adapter
            model = apply_lora(model, apply_values(cfg, {"model.lora_rank": 0, "model.lora_adapter_path": str(path)}))
        elif path is not None:  # a training checkpoint: a LoRA run's holds the adapters of model.lora_*
            model = apply_lora(model, cfg)
            load_checkpoint_policy(path, model)
    splits = load_splits(cfg)
    if not splits.val:
        raise ValueError("no validation prompts: set data.val_files (or use a built-in task)")
    prompts = tokenize_prompts(splits.val, tokenizer, cfg.data.max_prompt_length, cfg.data.overlong_prompts)
    r = cfg.rollout
    engine = NativeEngine(
        model, [tokenizer.eos_token_id], tokenizer.pad_token_id, r.chunk_size, max_num_seqs=r.max_num_seqs,
        max_num_batched_tokens=r.max_num_batched_tokens, enable_chunked_prefill=r.enable_chunked_prefill,
        enforce_eager=r.enforce_eager,
    )  # fmt: skip
    with RewardRunner(resolve_reward_function(splits.reward_spec), timeout_s=cfg.reward.timeout_s) as runner:
        metrics = validate(engine, tokenizer, prompts, runner, cfg, seed=cfg.trainer.seed)
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}")
    return metrics
