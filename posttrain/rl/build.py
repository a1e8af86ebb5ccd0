"""Build everything a training run needs, once, from the config and the batch plan.

Roles are built only when used: the reference policy when a KL term is on, the critic when the
advantage estimator needs values, the reward model when reward.model.enable is set.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import nn

from posttrain.algorithms.kl import KLController, make_kl_controller
from posttrain.config.errors import ConfigError
from posttrain.config.load import to_dict
from posttrain.config.plan import BatchPlan, build_plan
from posttrain.config.schema import PostTrainConfig
from posttrain.data.datasets import TokenizedPrompts, tokenize_prompts
from posttrain.data.sampler import PromptSampler
from posttrain.data.splits import Splits, load_splits
from posttrain.forward.options import PassOptions, attn_implementation, pass_options
from posttrain.models.critic import CriticModel
from posttrain.models.hf import load_causal_lm, load_tokenizer, resolve_dtype
from posttrain.models.lora import (
    apply_lora,
    is_lora_model,
    lora_memory_summary,
    policy_weights,
    reference_policy,
)
from posttrain.models.prepare import prepare_critic, prepare_policy
from posttrain.parallel import ulysses
from posttrain.parallel.data_parallel import DataParallel, data_parallel
from posttrain.parallel.fsdp import offload_optimizer_state, shard_model
from posttrain.parallel.runtime import DistContext, select_device
from posttrain.rewards.functions import resolve_reward_function
from posttrain.rewards.reward_model import RewardModelScorer
from posttrain.rewards.runner import RewardRunner
from posttrain.rl.checks import check_rl_switches
from posttrain.rl.evaluate import validation_params
from posttrain.rollout.native.engine import NativeEngine
from posttrain.sft.builtin import resolve_model_path, write_run_info
from posttrain.train.checkpoint import load_module_weights
from posttrain.train.trainable import Trainable

log = logging.getLogger("posttrain")


def load_checkpoint_policy(ckpt: Path, model: nn.Module) -> None:
    """Overlay a training checkpoint's actor weights on `model` (for `posttrain eval`)."""
    load_module_weights(ckpt, "actor", model)


@dataclass
class Components:
    cfg: PostTrainConfig
    plan: BatchPlan
    device: torch.device
    model_path: Path
    tokenizer: object
    actor: Trainable
    ref: nn.Module | None
    critic: Trainable | None
    engine: NativeEngine
    train_prompts: TokenizedPrompts
    val_prompts: TokenizedPrompts | None
    sampler: PromptSampler
    reward_runner: RewardRunner
    reward_model: RewardModelScorer | None
    kl_ctrl: KLController | None
    forward: PassOptions  # how each pass runs (packing, chunked head, offload): posttrain.models.prepare
    dist: DistContext = DistContext()
    parallel: dict[str, DataParallel] | None = None  # per pass: how its samples spread over ranks

    def dp(self, role: str) -> DataParallel:
        """The data-parallel view of a pass ("actor", "old_log_prob", "ref", "critic", "values")."""
        return self.parallel[role] if self.parallel else DataParallel()

    def close(self) -> None:
        self.reward_runner.close()


def _tokenize(
    cfg: PostTrainConfig, splits: Splits, tokenizer
) -> tuple[TokenizedPrompts, TokenizedPrompts | None]:
    d = cfg.data
    train = tokenize_prompts(splits.train, tokenizer, d.max_prompt_length, d.overlong_prompts)
    val = (
        tokenize_prompts(splits.val, tokenizer, d.max_prompt_length, d.overlong_prompts)
        if splits.val
        else None
    )
    for name, t in (("training", train), ("validation", val)):
        if t is not None and t.n_filtered:
            log.warning(
                "%d %s prompts are longer than data.max_prompt_length=%d and were dropped",
                t.n_filtered,
                name,
                d.max_prompt_length,
            )
    return train, val


def build_components(
    cfg: PostTrainConfig, quiet: bool = False, dist: DistContext | None = None
) -> Components:
    """Validate, then load models, data and rewards. Config errors surface before any model loads.

    With several ranks (``dist``), the trained and reference models are sharded with FSDP2 and the rollout
    engine holds its own full copy of the policy, refreshed after every update.
    """
    dist = dist or DistContext(device=select_device(cfg))
    plan = build_plan(cfg, dist.world_size)
    device = dist.device
    check_rl_switches(cfg, device, uses_ref=plan.ref is not None, uses_critic=plan.critic is not None)
    splits = load_splits(cfg)
    reward_fn = resolve_reward_function(splits.reward_spec, splits.data_source)
    if cfg.rollout.val_greedy and cfg.rollout.val_n > 1:
        validation_params(cfg, 0)  # raises the explanatory error
    model_path = resolve_model_path(cfg, quiet=quiet)
    tokenizer = load_tokenizer(model_path)
    # Sharded models on CUDA keep fp32 master weights and compute in model.dtype (FSDP2 mixed precision).
    master_dtype = "fp32" if dist.distributed and device.type == "cuda" else cfg.model.dtype
    policy = load_causal_lm(
        model_path,
        master_dtype,
        device,
        attn_implementation(cfg.model.use_remove_padding, device, cfg.actor.use_prefix_grouper),
    )
    rollout_model = None
    if dist.distributed:
        # Each rank's rollout engine holds a plain, unsharded copy, refreshed from the sharded actor after every
        # update (with LoRA: the merged weights). On one rank the engine shares the actor's module instead.
        rollout_model = copy.deepcopy(policy).to(resolve_dtype(cfg.model.dtype)).eval().requires_grad_(False)
    policy = apply_lora(policy, cfg)  # a PeftModel with model.lora_rank > 0; unchanged otherwise
    a = plan.actor
    actor_steps = cfg.trainer.total_steps * a.optimizer_steps_per_step
    ref = None
    if plan.ref is not None and is_lora_model(policy):
        ref = reference_policy(policy)  # the actor with adapters disabled: no copy of the base weights
    elif plan.ref is not None:
        ref = prepare_policy(copy.deepcopy(policy).eval().requires_grad_(False), cfg, trained=False)
    if is_lora_model(policy) and not quiet:
        print(lora_memory_summary(policy, uses_reference=ref is not None))
    policy = prepare_policy(policy, cfg)
    if dist.distributed:
        shard_model(policy, dist, cfg.actor.fsdp_config, resolve_dtype(cfg.model.dtype))
        if ref is not None and not is_lora_model(policy):
            shard_model(ref, dist, cfg.ref.fsdp_config, resolve_dtype(cfg.model.dtype))
    actor = Trainable.create(policy, cfg.actor.optim, actor_steps)
    offload_optimizer_state(actor.optimizer, device, cfg.actor.fsdp_config.optimizer_offload)
    critic = None
    if plan.critic is not None:
        critic_path = cfg.critic.model_path or model_path
        critic_module = CriticModel.from_causal_lm_path(
            critic_path,
            cfg.model.dtype,
            device,
            attn_implementation=attn_implementation(cfg.critic.use_remove_padding, device),
        )
        prepare_critic(critic_module, cfg)
        if dist.distributed:
            shard_model(critic_module, dist, cfg.critic.fsdp_config, resolve_dtype(cfg.model.dtype))
        critic_steps = cfg.trainer.total_steps * plan.critic.optimizer_steps_per_step
        critic = Trainable.create(critic_module, cfg.critic.optim, critic_steps)
        offload_optimizer_state(critic.optimizer, device, cfg.critic.fsdp_config.optimizer_offload)
    train_prompts, val_prompts = _tokenize(cfg, splits, tokenizer)
    if len(train_prompts.prompt_ids) < cfg.data.train_batch_size:
        raise ConfigError(
            f"data.train_batch_size ({cfg.data.train_batch_size}) exceeds the {len(train_prompts.prompt_ids)} "
            "training prompts available; lower it or add data"
        )
    sampler = PromptSampler(len(train_prompts.prompt_ids), cfg.data.train_batch_size, cfg.trainer.seed)
    eos = [tokenizer.eos_token_id]
    r = cfg.rollout
    engine = NativeEngine(
        policy if rollout_model is None else rollout_model,
        eos,
        tokenizer.pad_token_id,
        chunk_size=r.chunk_size,
        device=device,
        max_num_seqs=r.max_num_seqs,
        max_num_batched_tokens=r.max_num_batched_tokens,
        enable_chunked_prefill=r.enable_chunked_prefill,
        enforce_eager=r.enforce_eager,
    )
    runner = RewardRunner(
        reward_fn,
        timeout_s=cfg.reward.timeout_s or None,
        failure_reward=cfg.reward.failure_reward,
        fail_fast=cfg.reward.fail_fast,
    )
    rm = None
    if cfg.reward.model.enable:
        m = cfg.reward.model
        if not m.path:
            raise ConfigError(
                "reward.model.enable=true needs reward.model.path (a sequence-classification model dir)"
            )
        rm = RewardModelScorer(
            m.path,
            micro_batch_size=m.micro_batch_size_per_gpu,
            device=device,
            dtype=cfg.model.dtype,
            max_length=cfg.data.max_prompt_length + cfg.data.max_response_length,
            max_tokens=m.forward_max_token_len_per_gpu if m.use_dynamic_bsz else None,
            remove_padding=m.use_remove_padding,
            max_row_tokens=cfg.model.remove_padding_max_row_tokens,
        )
    kl_ctrl = None
    if cfg.algorithm.use_kl_in_reward:
        k = cfg.algorithm.kl_ctrl
        kl_ctrl = make_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
    if (
        rollout_model is not None
    ):  # e.g. a saved LoRA adapter (model.lora_adapter_path) is already on the actor
        engine.sync_weights(policy_weights(policy))
    forward = with_sequence_parallel(pass_options(cfg, device), cfg, policy.config)
    grouped = cfg.actor.use_prefix_grouper  # ranks get whole prompt groups, which the grouper computes once
    parallel = {
        "actor": data_parallel(dist, cfg.actor.ulysses_sequence_parallel_size, grouped),
        "old_log_prob": data_parallel(dist, cfg.actor.ulysses_sequence_parallel_size, grouped),
        "ref": data_parallel(dist, cfg.ref.ulysses_sequence_parallel_size, grouped),
        "critic": data_parallel(dist, cfg.critic.ulysses_sequence_parallel_size),
        "values": data_parallel(dist, cfg.critic.ulysses_sequence_parallel_size),
    }
    return Components(
        cfg,
        plan,
        device,
        model_path,
        tokenizer,
        actor,
        ref,
        critic,
        engine,
        train_prompts,
        val_prompts,
        sampler,
        runner,
        rm,
        kl_ctrl,
        forward,
        dist,
        parallel,
    )


def with_sequence_parallel(options: PassOptions, cfg: PostTrainConfig, model_config) -> PassOptions:
    """Each pass's Ulysses SP group (ranks ``[d * sp, (d + 1) * sp)``), created once per distinct SP size.

    A collective (every rank creates every group); a no-op when every SP size is 1.
    """
    sizes = {
        "actor": cfg.actor.ulysses_sequence_parallel_size,
        "old_log_prob": cfg.actor.ulysses_sequence_parallel_size,
        "ref": cfg.ref.ulysses_sequence_parallel_size,
        "critic": cfg.critic.ulysses_sequence_parallel_size,
    }
    if all(sp == 1 for sp in sizes.values()):
        return options

    groups = {}
    for sp in sorted(set(sizes.values())):
        ulysses.check_sequence_parallel_supported(model_config, sp)
        groups[sp] = ulysses.new_sequence_parallel_group(sp)
    ulysses.install_ulysses_attention()
    return dataclasses.replace(
        options,
        **{p: dataclasses.replace(getattr(options, p), sp_group=groups[sp]) for p, sp in sizes.items()},
    )


def write_run_metadata(
    run_dir: Path, cfg: PostTrainConfig, plan: BatchPlan, model_path: Path | None = None
) -> None:
    """The resolved config and the plan, next to the metrics, so a run explains itself. ``model_path``: the
    directory model.path resolved to (a built-in model's cache entry, a Hub snapshot), recorded in
    run_info.yaml, not config.yaml, so config.yaml stays a config that loads as it is."""

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    if model_path is not None:
        write_run_info(run_dir, cfg, model_path)
    (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2))
