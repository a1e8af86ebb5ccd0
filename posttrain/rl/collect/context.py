"""What a rollout needs, and nothing the trainer needs: the engine, the prompts and their sampler, the reward.

The synchronous loop and the rollout thread take these from the trainer's :class:`Components`
(:func:`rollout_context_of`); a rollout worker in its own process builds them from the config alone
(:func:`build_rollout_context`), without the actor, the critic or an optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.config.schema import PostTrainConfig
from posttrain.data.batch import RolloutBatch
from posttrain.data.datasets import TokenizedPrompts
from posttrain.data.sampler import PromptSampler
from posttrain.forward.options import attn_implementation
from posttrain.models.hf import load_causal_lm, load_tokenizer
from posttrain.parallel.runtime import DistContext
from posttrain.parallel.shares import SINGLE_SHARE, DataShare
from posttrain.rewards.reward_model import RewardModelScorer
from posttrain.rewards.runner import RewardRunner
from posttrain.rl.build import (
    Components,
    build_engine,
    build_prompts,
    build_reward_model,
    build_reward_runner,
    check_run,
)
from posttrain.rollout.base import RolloutEngine


@dataclass
class RolloutContext:
    """The parts of a run that draw, generate and score a step's samples
    (``posttrain.rl.collect.rollout.rollout_phase``) and validate (``posttrain.rl.collect.validation.validate``)."""

    cfg: PostTrainConfig
    engine: RolloutEngine
    tokenizer: object
    train_prompts: TokenizedPrompts
    val_prompts: TokenizedPrompts | None
    sampler: PromptSampler
    reward_runner: RewardRunner
    reward_model: RewardModelScorer | None
    dist: DistContext = DistContext()
    share: DataShare = SINGLE_SHARE

    def close(self) -> None:
        self.reward_runner.close()
        self.engine.close()


@dataclass
class GeneratedStep:
    """One step's samples, their rollout metrics, and the prompt sampler's state before they were drawn."""

    batch: RolloutBatch
    metrics: dict[str, float]
    sampler_before: dict


@dataclass
class StartedStep:
    """What the trainer hears of a partial rollout's start: the prompt sampler's state before it drew."""

    sampler_before: dict


def rollout_context_of(c: Components) -> RolloutContext:
    """The trainer's own rollout parts (one process, or this rank's share with several)."""
    return RolloutContext(
        cfg=c.cfg,
        engine=c.engine,
        tokenizer=c.tokenizer,
        train_prompts=c.train_prompts,
        val_prompts=c.val_prompts,
        sampler=c.sampler,
        reward_runner=c.reward_runner,
        reward_model=c.reward_model,
        dist=c.dist,
        share=c.share,
    )


def build_rollout_context(cfg: PostTrainConfig, model_path: Path, device: torch.device) -> RolloutContext:
    """Everything a rollout worker process needs, from the config and the model directory the trainer
    resolved (``model_path``): the same checks, data, sampler and reward as the trainer's, and an engine over
    a fresh copy of the weights (the trainer pushes its current ones before the first rollout)."""
    plan, splits = check_run(cfg, 1, device)
    runner = build_reward_runner(cfg, splits.reward_spec, splits.data_source)
    tokenizer = load_tokenizer(model_path)
    train_prompts, val_prompts, sampler = build_prompts(cfg, splits, tokenizer)
    # vLLM loads the weights itself; the native engine decodes with a plain module of its own.
    model = None
    if cfg.rollout.name != "vllm":  # the attention the trainer's copy would use: the same samples
        grouped = cfg.actor.use_prefix_grouper or (plan.ref is not None and cfg.ref.use_prefix_grouper)
        attn = attn_implementation(cfg.model.use_remove_padding, device, grouped)
        model = load_causal_lm(model_path, cfg.model.dtype, device, attn).eval().requires_grad_(False)
    return RolloutContext(
        cfg=cfg,
        engine=build_engine(cfg, model, tokenizer, device, model_path),
        tokenizer=tokenizer,
        train_prompts=train_prompts,
        val_prompts=val_prompts,
        sampler=sampler,
        reward_runner=runner,
        reward_model=build_reward_model(cfg, plan, device),
    )
