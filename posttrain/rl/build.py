"""Build everything a training run needs, once, from the config and the batch plan.

Roles are built only when used: the reference policy when a KL term is on, the critic when the
advantage estimator needs values, the reward model when reward.model.enable is set, the distillation
teacher when distill.teacher.path is set.
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
from posttrain.config.schema.harness import harness_enabled
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
    reference_policy,
)
from posttrain.models.model_path import resolve_model_path, write_run_info
from posttrain.models.prepare import prepare_critic, prepare_policy
from posttrain.parallel import ulysses
from posttrain.parallel.data_parallel import DataParallel, data_parallel
from posttrain.parallel.fsdp import offload_optimizer_state, shard_model
from posttrain.parallel.runtime import DistContext, select_device
from posttrain.parallel.shares import data_share
from posttrain.rewards.combine import RewardWeights
from posttrain.rewards.functions import resolve_reward_function
from posttrain.rewards.judge import build_judge
from posttrain.rewards.process_reward import build_process_reward, check_prm_config
from posttrain.rewards.reward_model import RewardModelScorer
from posttrain.rewards.runner import RewardRunner
from posttrain.rl.checks import check_async_training, check_rl_switches, check_rollout_backend
from posttrain.rl.collect.context import RolloutContext
from posttrain.rl.collect.harness_loop import build_rollout_loop
from posttrain.rl.collect.validation import validation_params
from posttrain.rl.remote_teacher import RemoteTeacher, remote_teacher
from posttrain.rl.teacher import build_teacher, check_distill, judge_dir
from posttrain.rl.teacher_routing import check_route_sources, teacher_dirs, teacher_route
from posttrain.rollout.base import RolloutEngine
from posttrain.rollout.native.engine import NativeEngine
from posttrain.rollout.vllm.factory import build_vllm_engine
from posttrain.rollout.weights import RolloutWeights
from posttrain.sandbox.build import RunSandbox
from posttrain.sft.builtin import builtin_model_dir
from posttrain.train.checkpoint import load_module_weights
from posttrain.train.checkpoint_index import check_resume_setting
from posttrain.train.trainable import Trainable

log = logging.getLogger("posttrain")


def load_checkpoint_policy(ckpt: Path, model: nn.Module) -> None:
    """Overlay a training checkpoint's actor weights on `model` (for `posttrain eval`)."""
    load_module_weights(ckpt, "actor", model)


@dataclass(kw_only=True)
class Components(RolloutContext):
    """The run's parts: its rollout context (config, engine, tokenizer, prompts, sampler, rewards, ranks and
    share) and the trainer's own parts below. The synchronous step and the rollout thread collect with it as
    it is; a rollout worker process builds a context of its own (:func:`build_rollout_context`)."""

    plan: BatchPlan
    device: torch.device
    model_path: Path
    actor: Trainable
    ref: nn.Module | None
    critic: Trainable | None
    engine: (
        RolloutEngine | None
    )  # None: a rollout worker process holds it (async_training.rollout_worker=ray)
    # Pushes the actor's weights into the engine (a no-op when it shares them); None without a local engine.
    rollout_weights: RolloutWeights | None
    kl_ctrl: KLController | None
    # the frozen distillation teacher (distill.teacher.path) or the remote one (distill.teacher.base_url)
    teacher: nn.Module | RemoteTeacher | None = None
    # distill.teachers: the frozen teachers in teacher_route's order (teacher i scores the rows routed to i)
    routed_teachers: tuple[nn.Module, ...] = ()
    forward: PassOptions  # how each pass runs (packing, chunked head, offload): posttrain.models.prepare
    parallel: dict[str, DataParallel] | None = None  # per pass: how its samples spread over ranks

    def dp(self, role: str) -> DataParallel:
        """The data-parallel view of a pass ("actor", "old_log_prob", "ref", "teacher", "critic", "values")."""
        return self.parallel[role] if self.parallel else DataParallel()

    def close(self) -> None:
        """The reward runner and the rollout loop (a harness's gateway): the train command closes the engine
        after the ranks' last collective."""
        self.reward_runner.close()
        if self.agent is not None:
            self.agent.close()


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


def check_config(cfg: PostTrainConfig, world_size: int, device: torch.device) -> BatchPlan:
    """Every check of an RL run that needs neither weights nor data, in order: the batch plan, the switches of
    each role, the rollout backend, async training, validation, trainer.resume. `posttrain explain` and
    `posttrain train` both run it (posttrain.planning.preflight), so explain accepts what train accepts."""
    plan = build_plan(cfg, world_size)
    check_rl_switches(cfg, device, uses_ref=plan.ref is not None, uses_critic=plan.critic is not None)
    check_distill(cfg, world_size)
    check_rollout_backend(cfg, device, world_size)
    check_async_training(cfg, world_size)
    validation_params(cfg, 0)  # e.g. rollout.val_n > 1 with greedy validation
    check_resume_setting(cfg.trainer.run_dir, cfg.trainer.resume)
    _check_generated_task_size(cfg)
    return plan


def _check_generated_task_size(cfg: PostTrainConfig) -> None:
    """The built-in task generates data.num_train_examples prompts: a step draws data.train_batch_size."""
    d = cfg.data
    if d.train_files or d.val_files or d.task == "gsm8k":
        return
    if d.num_train_examples < d.train_batch_size:
        raise ConfigError(
            f"data.num_train_examples={d.num_train_examples} is fewer than data.train_batch_size="
            f"{d.train_batch_size}, the prompts one step draws; set data.num_train_examples >= "
            f"{d.train_batch_size} or lower data.train_batch_size"
        )


def check_run(cfg: PostTrainConfig, world_size: int, device: torch.device) -> tuple[BatchPlan, Splits]:
    """:func:`check_config`, then the data files and the reward function. Raises ConfigError before anything
    heavy loads."""
    plan = check_config(cfg, world_size, device)
    splits = load_splits(cfg)
    return plan, splits


def local_engine(cfg: PostTrainConfig) -> bool:
    """Whether this process holds the rollout engine (not when Ray placed a rollout worker elsewhere)."""
    return not (cfg.async_training.enable and cfg.async_training.rollout_worker == "ray")


@dataclass
class Policy:
    """The actor (trained), the reference policy (frozen; None without a KL term) and the module the rollout
    engine decodes with (the actor's own on one rank; a plain unsharded copy when the actor is sharded)."""

    actor: Trainable
    ref: nn.Module | None
    rollout_model: nn.Module


def build_policy(
    cfg: PostTrainConfig, plan: BatchPlan, dist: DistContext, model_path: Path, quiet: bool = False
) -> Policy:
    """Load the policy once; derive the reference (LoRA: the adapters disabled) and the rollout copy from it;
    apply the model switches, then FSDP2 on several ranks."""
    device = dist.device
    # Sharded models on CUDA keep fp32 master weights and compute in model.dtype (FSDP2 mixed precision).
    master_dtype = "fp32" if dist.distributed and device.type == "cuda" else cfg.model.dtype
    # The reference is a copy of this module: either pass's prefix grouper needs the shared-prefix attention.
    grouped = cfg.actor.use_prefix_grouper or (plan.ref is not None and cfg.ref.use_prefix_grouper)
    attn = attn_implementation(cfg.model.use_remove_padding, device, grouped)
    policy = load_causal_lm(model_path, master_dtype, device, attn)
    rollout_model = None
    if (dist.distributed or cfg.async_training.enable) and cfg.rollout.name == "native" and local_engine(cfg):
        # Each rank's rollout engine holds a plain, unsharded copy, refreshed from the sharded actor after every
        # update (with LoRA: the merged weights); so does an engine sampling ahead of training while it trains.
        # On one synchronous rank the engine shares the actor's module instead.
        rollout_model = copy.deepcopy(policy).to(resolve_dtype(cfg.model.dtype)).eval().requires_grad_(False)
    policy = apply_lora(policy, cfg)  # a PeftModel with model.lora_rank > 0; unchanged otherwise
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
    actor = Trainable.create(
        policy, cfg.actor.optim, cfg.trainer.total_steps * plan.actor.optimizer_steps_per_step
    )
    offload_optimizer_state(actor.optimizer, device, cfg.actor.fsdp_config.optimizer_offload)
    return Policy(actor, ref, policy if rollout_model is None else rollout_model)


def build_critic(
    cfg: PostTrainConfig, plan: BatchPlan, dist: DistContext, model_path: Path
) -> Trainable | None:
    """The value model (the policy's backbone with a scalar head, or critic.model_path); None when unused."""
    if plan.critic is None:
        return None
    c = cfg.critic
    module = CriticModel.from_causal_lm_path(
        c.model_path or model_path,
        cfg.model.dtype,
        dist.device,
        attn_implementation=attn_implementation(c.use_remove_padding, dist.device),
    )
    prepare_critic(module, cfg)
    if dist.distributed:
        shard_model(module, dist, c.fsdp_config, resolve_dtype(cfg.model.dtype))
    critic = Trainable.create(module, c.optim, cfg.trainer.total_steps * plan.critic.optimizer_steps_per_step)
    offload_optimizer_state(critic.optimizer, dist.device, c.fsdp_config.optimizer_offload)
    return critic


def build_engine(
    cfg: PostTrainConfig, model: nn.Module, tokenizer, device: torch.device, model_path: Path | None = None
) -> RolloutEngine:
    """The rollout engine of `rollout.*`: the native engine over ``model`` (shared with the trainer, or its own
    copy), or vLLM (`rollout.name=vllm`) reading ``model_path`` and kept current by weight pushes."""
    r = cfg.rollout
    if r.name == "vllm":
        return build_vllm_engine(
            model_path,
            tokenizer,
            r,
            cfg.model.dtype,
            cfg.trainer.seed,
            device.type,
            max_prompt_length=cfg.data.max_prompt_length,
            max_response_length=cfg.data.max_response_length,
            lora_rank=cfg.model.lora_rank,
            lora_merge=cfg.model.lora_merge,
        )
    return NativeEngine(
        model,
        [tokenizer.eos_token_id],
        tokenizer.pad_token_id,
        chunk_size=r.chunk_size,
        device=device,
        max_num_seqs=r.max_num_seqs,
        max_num_batched_tokens=r.max_num_batched_tokens,
        enable_chunked_prefill=r.enable_chunked_prefill,
        enforce_eager=r.enforce_eager,
        # Multi-turn: a cache as long as a whole trajectory from the start, so no turn outgrows it (which would
        # end the sessions whose prefixes later turns reuse).
        max_model_len=(r.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length)
        if r.multi_turn.enable or harness_enabled(cfg.harness)
        else None,
    )


def build_reward_runner(
    cfg: PostTrainConfig, reward_spec: str, data_source: str = "", sandbox: RunSandbox | None = None
) -> RewardRunner:
    """The reward function of ``reward_spec`` behind the `reward.*` guards (timeout, failure reward, fail fast);
    ``data_source`` is what a verl-style ``compute_score`` receives; ``sandbox``, the run's, where code rewards
    run their programs (one of the `sandbox` section's own when none is given)."""
    rw = cfg.reward
    return RewardRunner(
        resolve_reward_function(reward_spec, data_source, sandbox or RunSandbox(cfg.sandbox)),
        timeout_s=rw.timeout_s or None,
        failure_reward=rw.failure_reward,
        fail_fast=rw.fail_fast,
    )


def build_reward_model(
    cfg: PostTrainConfig, plan: BatchPlan, device: torch.device
) -> RewardModelScorer | None:
    """The sequence-classification reward model, in the micro-batches the plan computed for it."""
    rp = plan.reward_model
    if rp is None:
        return None
    m = cfg.reward.model
    if not m.path:
        raise ConfigError(
            "reward.model.enable=true needs reward.model.path (a sequence-classification model dir)"
        )
    scorer = RewardModelScorer(
        m.path,
        micro_batch_size=rp.micro_batch_size_per_rank or 1,
        device=device,
        dtype=m.dtype,
        max_length=plan.max_seq_len,
        max_tokens=rp.max_token_len_per_rank,
        remove_padding=m.use_remove_padding,
        max_row_tokens=m.remove_padding_max_row_tokens,
    )
    RewardWeights.from_config(cfg, scorer.model.config)  # reward.model.normalize's stats, checked at build
    return scorer


def build_prompts(
    cfg: PostTrainConfig, splits: Splits, tokenizer
) -> tuple[TokenizedPrompts, TokenizedPrompts | None, PromptSampler]:
    """Tokenized training and validation prompts and the per-step prompt sampler."""
    train, val = _tokenize(cfg, splits, tokenizer)
    if len(train.prompt_ids) < cfg.data.train_batch_size:
        raise ConfigError(
            f"data.train_batch_size ({cfg.data.train_batch_size}) exceeds the {len(train.prompt_ids)} "
            "training prompts available; lower it or add data"
        )
    return train, val, PromptSampler(len(train.prompt_ids), cfg.data.train_batch_size, cfg.trainer.seed)


def build_kl_controller(cfg: PostTrainConfig) -> KLController | None:
    """The in-reward KL coefficient (fixed or adaptive); None when `algorithm.use_kl_in_reward` is off."""
    if not cfg.algorithm.use_kl_in_reward:
        return None
    k = cfg.algorithm.kl_ctrl
    return make_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)


def build_parallel(cfg: PostTrainConfig, plan: BatchPlan, dist: DistContext) -> dict[str, DataParallel]:
    """The data-parallel view of each pass that runs; the prefix grouper wants whole prompt groups per rank.
    Every view knows how many ranks hold one share of the data (``plan.share_replicas``)."""
    grouped, ref_grouped = cfg.actor.use_prefix_grouper, cfg.ref.use_prefix_grouper
    share = plan.share_replicas
    views = {
        "actor": data_parallel(dist, plan.actor.sp_size, grouped, share),
        "old_log_prob": data_parallel(dist, plan.actor.sp_size, grouped, share),
    }
    if plan.ref is not None:
        views["ref"] = data_parallel(dist, plan.ref.sp_size, ref_grouped, share)
    if plan.teacher is not None:  # the layout of pass_options' teacher entry
        teacher_grouped = grouped and not cfg.distill.teacher.use_remove_padding
        views["teacher"] = data_parallel(dist, plan.teacher.sp_size, teacher_grouped, share)
    if plan.critic is not None:
        views["critic"] = data_parallel(dist, plan.critic.sp_size, False, share)
        views["values"] = data_parallel(dist, plan.critic.sp_size, False, share)
    return views


def build_components(
    cfg: PostTrainConfig, quiet: bool = False, dist: DistContext | None = None
) -> Components:
    """Check, then load models, data and rewards: the one builder `train`, `eval`, `tune` and the benchmarks use.

    With several ranks (``dist``), the trained and reference models are sharded with FSDP2 and the rollout
    engine holds its own full copy of the policy, refreshed after every update.
    """
    dist = dist or DistContext(device=select_device(cfg))
    plan, splits = check_run(cfg, dist.world_size, dist.device)
    sandbox = RunSandbox(cfg.sandbox)  # the run's one sandbox: the code reward's and the python tool's
    # the user's reward is imported (and the sandbox built, for a code reward) before any model loads
    runner = build_reward_runner(cfg, splits.reward_spec, splits.data_source, sandbox)
    judge = build_judge(cfg, judge_dir(cfg, builtin_model_dir, quiet), dist.device)  # before the policy loads
    check_prm_config(cfg)  # the PRM's directory and config, before any model loads
    model_path = resolve_model_path(cfg, quiet=quiet, warm_start=builtin_model_dir)
    tokenizer = load_tokenizer(model_path)
    # the teachers' tokenizers are compared with the student's before any weights load
    route, teacher_dir, routed_dirs = teacher_dirs(
        cfg, plan.teacher is not None, splits.data_source, model_path, builtin_model_dir, quiet
    )
    train_prompts, val_prompts, sampler = build_prompts(cfg, splits, tokenizer)
    check_route_sources(route, train_prompts.records)  # a source the data lacks: refused before weights load
    policy = build_policy(cfg, plan, dist, model_path, quiet)
    critic = build_critic(cfg, plan, dist, model_path)
    engine = weights = None  # a rollout worker of its own builds the engine where Ray placed it
    if local_engine(cfg):
        engine = build_engine(cfg, policy.rollout_model, tokenizer, dist.device, model_path)
        weights = RolloutWeights(cfg, engine)
        weights.push(policy.actor.module)  # e.g. a saved LoRA adapter is on the actor (no-op when shared)
    forward = with_sequence_parallel(pass_options(cfg, dist.device), cfg, policy.actor.module.config)
    return Components(
        cfg=cfg,
        plan=plan,
        device=dist.device,
        model_path=model_path,
        tokenizer=tokenizer,
        actor=policy.actor,
        ref=policy.ref,
        critic=critic,
        engine=engine,
        rollout_weights=weights,
        train_prompts=train_prompts,
        val_prompts=val_prompts,
        sampler=sampler,
        reward_runner=runner,
        reward_model=build_reward_model(cfg, plan, dist.device),
        judge=judge,
        prm=build_process_reward(cfg, dist.device),
        generation_device=dist.device.type,
        agent=build_rollout_loop(cfg, tokenizer, sandbox),
        kl_ctrl=build_kl_controller(cfg),
        teacher=build_teacher(cfg, teacher_dir, dist) if teacher_dir is not None else remote_teacher(cfg),
        routed_teachers=tuple(build_teacher(cfg, d, dist) for d in routed_dirs),
        teacher_route=route,
        forward=forward,
        dist=dist,
        parallel=build_parallel(cfg, plan, dist),
        share=data_share(dist, plan.share_replicas),  # a collective: every rank makes every share's group
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


def build_rollout_context(cfg: PostTrainConfig, model_path: Path, device: torch.device) -> RolloutContext:
    """Everything a rollout worker process needs, from the config and the model directory the trainer
    resolved (``model_path``): the same checks, data, sampler and reward as the trainer's, and an engine over
    a fresh copy of the weights (the trainer pushes its current ones before the first rollout)."""
    plan, splits = check_run(cfg, 1, device)
    sandbox = RunSandbox(cfg.sandbox)  # the rollout worker's: its reward and its python tool share it
    runner = build_reward_runner(cfg, splits.reward_spec, splits.data_source, sandbox)
    judge = build_judge(cfg, judge_dir(cfg, builtin_model_dir, True), device)
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
        judge=judge,
        prm=build_process_reward(cfg, device),
        agent=build_rollout_loop(cfg, tokenizer, sandbox),
        generation_device=device.type,
        teacher_route=teacher_route(cfg, splits.data_source),
    )
