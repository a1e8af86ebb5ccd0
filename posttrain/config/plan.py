"""The batch plan: every batch size of a training step, derived once from config + world shape.

The plan is frozen; nothing downstream recomputes or mutates batch arithmetic. Units:
- prompts: unique prompts; samples: prompts x rollout.n.
- "per rank" means per data-parallel (DP) rank; DP size = world size / Ulysses SP size.

Rules checked here (each failure is a ValueError naming keys, values, the rule and nearby valid values):
1. data.train_batch_size % <role>.ppo_mini_batch_size == 0 (SkyRL, trlx: whole mini-batches per step).
2. <role>.ppo_mini_batch_size * rollout.n % DP == 0 and >= DP (verl's normalisation: a non-empty,
   equal share of every mini-batch on every DP rank).
3. mini-batch per rank % <role>.ppo_micro_batch_size_per_gpu == 0 and micro <= mini per rank
   (fixed micro-batches; gradient accumulation steps = mini per rank / micro).
4. world size % <role>.ulysses_sequence_parallel_size == 0.
5. with dynamic batch size on, every token budget x SP >= max_prompt_length + max_response_length (a
   single sample must fit one micro-batch).
6. group-based estimators (grpo, drgrpo, rloo, reinforce_plus_plus_baseline) need rollout.n >= 2.
7. <role>.fsdp_config.fsdp_size is -1 (all ranks) or divides the world size (HSDP groups).
8. rollout.max_num_batched_tokens >= rollout.max_num_seqs (every decoding sequence adds a token to a forward).
9. data.train_batch_size >= the number of data shares (world size / the ranks holding one share, the least
   common multiple of the SP sizes): each data-parallel rank keeps whole prompt groups (rank-local data).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from posttrain.algorithms.names import estimator_needs
from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.config.schema.distill import distill_enabled


@dataclass(frozen=True)
class ForwardPlan:
    """A forward-only pass (old log-probs, reference log-probs, values, reward-model scores)."""

    role: str
    dp_size: int
    sp_size: int
    samples_per_rank: int
    use_dynamic_bsz: bool
    micro_batch_size_per_rank: int | None
    max_token_len_per_rank: int | None
    passes_per_rank: int | None  # fixed micro-batches: forward passes per rank per step


@dataclass(frozen=True)
class UpdatePlan:
    """A training role's update: epochs x mini-batches x micro-batches."""

    role: str
    dp_size: int
    sp_size: int
    ppo_epochs: int
    mini_batch_prompts: int
    mini_batch_samples: int
    mini_batches_per_epoch: int
    optimizer_steps_per_step: int
    mini_batch_samples_per_rank: int
    use_dynamic_bsz: bool
    micro_batch_size_per_rank: int | None
    grad_accum_steps: int | None
    max_token_len_per_rank: int | None


@dataclass(frozen=True)
class BatchPlan:
    """The whole step's batch arithmetic. Keys of `to_dict()` are stable (docs/batch-plan.md)."""

    world_size: int
    prompts_per_step: int
    n: int
    samples_per_step: int
    max_seq_len: int
    rollout_chunk_prompts: int
    rollout_chunks_per_step: int
    actor: UpdatePlan
    old_log_prob: ForwardPlan
    ref: ForwardPlan | None
    critic: UpdatePlan | None
    values: ForwardPlan | None
    reward_model: ForwardPlan | None
    teacher: ForwardPlan | None = None  # the distillation teacher's log-probs (distill.teacher.path set)
    old_log_prob_source: str = "recompute"  # see :func:`old_log_prob_source`
    rollout_staleness: int = 0  # steps the rollout runs ahead of training (async_training), 0: synchronous
    partial_rollout_tokens: int = (
        0  # tokens per response generated ahead (async_training.partial_rollout), 0: off
    )

    @property
    def share_replicas(self) -> int:
        """Ranks that hold one share of a step's samples (rank-local data): the least common multiple of the SP
        sizes of the passes that run, so that every SP group holds one share."""
        sizes = [self.actor.sp_size] + [p.sp_size for p in (self.ref, self.critic) if p is not None]
        return math.lcm(*sizes)

    @property
    def max_policy_lag(self) -> int:
        """Optimizer steps between the rollout policy and the policy updating on the last mini-batch: the
        step's own updates, plus every update of the steps the rollout ran ahead of."""
        steps = self.actor.optimizer_steps_per_step
        return self.rollout_staleness * steps + steps - 1

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["max_policy_lag"] = self.max_policy_lag
        return d


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(candidates: list[int], target: int, k: int = 2) -> str:
    best = sorted(set(candidates), key=lambda c: (abs(c - target), c))[:k]
    return " or ".join(str(b) for b in sorted(best))


def _dp_size(world_size: int, sp: int, key: str) -> int:
    if world_size % sp != 0:
        valid = _nearest(_divisors(world_size), sp)
        raise ConfigError(
            f"{key}={sp} must divide the world size ({world_size}): each data-parallel rank is a group "
            f"of {key} GPUs. Nearest valid: {key}={valid}"
        )
    return world_size // sp


def fsdp_group_size(fsdp_size: int, world_size: int, key: str) -> int:
    """GPUs sharing one copy of a role's model states: ``fsdp_size`` (-1: all ranks); it must divide the world."""
    if fsdp_size == -1:
        return world_size
    if fsdp_size < 1 or world_size % fsdp_size != 0:
        valid = _nearest(_divisors(world_size), max(fsdp_size, 1))
        raise ConfigError(
            f"{key}={fsdp_size} must divide the world size ({world_size}): the ranks form groups of {key} GPUs "
            f"that each shard one copy of the model. Use -1 (shard over all ranks) or {key}={valid}"
        )
    return fsdp_size


def _update_plan(cfg: PostTrainConfig, role: str, world_size: int) -> UpdatePlan:
    rc = getattr(cfg, role)
    tbs, n = cfg.data.train_batch_size, cfg.rollout.n
    sp = rc.ulysses_sequence_parallel_size
    dp = _dp_size(world_size, sp, f"{role}.ulysses_sequence_parallel_size")
    mini = rc.ppo_mini_batch_size
    if mini > tbs or tbs % mini != 0:
        raise ConfigError(
            f"data.train_batch_size ({tbs}) must be a multiple of {role}.ppo_mini_batch_size ({mini}) "
            f"(both count prompts; each step splits into whole mini-batches). Nearest valid: "
            f"{role}.ppo_mini_batch_size={_nearest(_divisors(tbs), mini)}"
        )
    mini_samples = mini * n
    if mini_samples % dp != 0:
        valid = [m for m in _divisors(tbs) if (m * n) % dp == 0]
        hint = (
            f"{role}.ppo_mini_batch_size={_nearest(valid, mini)}"
            if valid
            else "a data.train_batch_size divisible by DP"
        )
        raise ConfigError(
            f"{role}.ppo_mini_batch_size ({mini}) x rollout.n ({n}) = {mini_samples} samples must split "
            f"evenly over {dp} data-parallel ranks (world {world_size} / SP {sp}), with at least one "
            f"sample each. Nearest valid: {hint}"
        )
    per_rank = mini_samples // dp
    micro = accum = None
    budget = None
    if rc.use_dynamic_bsz:
        budget = _check_budget(cfg, f"{role}.ppo_max_token_len_per_gpu", rc.ppo_max_token_len_per_gpu, sp)
    else:
        micro = rc.ppo_micro_batch_size_per_gpu
        if micro > per_rank or per_rank % micro != 0:
            raise ConfigError(
                f"{role}.ppo_micro_batch_size_per_gpu ({micro}) must divide the mini-batch per DP rank "
                f"({per_rank} samples = {role}.ppo_mini_batch_size {mini} x rollout.n {n} / DP {dp}) so "
                f"that gradient accumulation covers it exactly. Nearest valid: "
                f"{role}.ppo_micro_batch_size_per_gpu={_nearest(_divisors(per_rank), micro)}"
            )
        accum = per_rank // micro
    per_epoch = tbs // mini
    return UpdatePlan(
        role=role,
        dp_size=dp,
        sp_size=sp,
        ppo_epochs=rc.ppo_epochs,
        mini_batch_prompts=mini,
        mini_batch_samples=mini_samples,
        mini_batches_per_epoch=per_epoch,
        optimizer_steps_per_step=per_epoch * rc.ppo_epochs,
        mini_batch_samples_per_rank=per_rank,
        use_dynamic_bsz=rc.use_dynamic_bsz,
        micro_batch_size_per_rank=micro,
        grad_accum_steps=accum,
        max_token_len_per_rank=budget,
    )


def _check_budget(cfg: PostTrainConfig, key: str, budget: int, sp: int) -> int:
    """The budget of one DP rank's micro-batch: a per-GPU budget x the SP size (as in verl: with Ulysses SP
    each GPU holds 1/sp of every micro-batch's tokens). The longest sample must fit."""
    need = cfg.data.max_prompt_length + cfg.data.max_response_length
    if budget * sp < need:
        per_gpu = -(-need // sp)
        raise ConfigError(
            f"{key} ({budget}) x ulysses_sequence_parallel_size ({sp}) must be at least data.max_prompt_length "
            f"+ data.max_response_length ({cfg.data.max_prompt_length} + {cfg.data.max_response_length} = "
            f"{need}) so that the longest sample fits one micro-batch. Set {key}={per_gpu} or more (verl's "
            f"advice: 2-3x, i.e. {2 * per_gpu})"
        )
    return budget * sp


FORWARD_PASSES = {
    # pass: (its config section, dynamic-batch key, micro-batch key, token-budget key); SP from the section
    "old_log_prob": (
        "actor",
        "use_dynamic_bsz",
        "log_prob_micro_batch_size_per_gpu",
        "log_prob_max_token_len_per_gpu",
    ),
    "ref": (
        "ref",
        "log_prob_use_dynamic_bsz",
        "log_prob_micro_batch_size_per_gpu",
        "log_prob_max_token_len_per_gpu",
    ),
    "teacher": (
        "distill.teacher",
        "log_prob_use_dynamic_bsz",
        "log_prob_micro_batch_size_per_gpu",
        "log_prob_max_token_len_per_gpu",
    ),
    "values": (
        "critic",
        "use_dynamic_bsz",
        "forward_micro_batch_size_per_gpu",
        "forward_max_token_len_per_gpu",
    ),
    "reward_model": (
        "reward.model",
        "use_dynamic_bsz",
        "micro_batch_size_per_gpu",
        "forward_max_token_len_per_gpu",
    ),
}


def _forward_plan(cfg: PostTrainConfig, role: str, world_size: int) -> ForwardPlan:
    """A forward-only pass's plan from its section's keys (:data:`FORWARD_PASSES`)."""
    name, dynamic_key, micro_key, budget_key = FORWARD_PASSES[role]
    section = cfg
    for part in name.split("."):
        section = getattr(section, part)
    sp = getattr(section, "ulysses_sequence_parallel_size", 1)
    dp = _dp_size(world_size, sp, f"{name}.ulysses_sequence_parallel_size")
    samples = cfg.data.train_batch_size * cfg.rollout.n
    if samples % dp != 0:
        raise ConfigError(
            f"data.train_batch_size ({cfg.data.train_batch_size}) x rollout.n ({cfg.rollout.n}) = {samples} "
            f"samples must split evenly over {dp} data-parallel ranks for the {role} pass"
        )
    per_rank = samples // dp
    if getattr(section, dynamic_key):
        budget = _check_budget(cfg, f"{name}.{budget_key}", getattr(section, budget_key), sp)
        return ForwardPlan(role, dp, sp, per_rank, True, None, budget, None)
    micro = getattr(section, micro_key)
    return ForwardPlan(role, dp, sp, per_rank, False, micro, None, -(-per_rank // micro))


def build_sft_plan(cfg: PostTrainConfig, world_size: int = 1) -> UpdatePlan:
    """SFT's plan: sft.batch_size examples per optimizer step over DP ranks, fixed micro-batches."""
    s = cfg.sft
    if s.batch_size % world_size != 0:
        raise ConfigError(
            f"sft.batch_size ({s.batch_size}) must split evenly over {world_size} data-parallel ranks. "
            f"Nearest valid: sft.batch_size={_nearest([m * world_size for m in range(1, s.batch_size + 1)], s.batch_size)}"
        )
    per_rank = s.batch_size // world_size
    micro = s.micro_batch_size_per_gpu
    if micro > per_rank or per_rank % micro != 0:
        raise ConfigError(
            f"sft.micro_batch_size_per_gpu ({micro}) must divide the examples per DP rank per step "
            f"({per_rank} = sft.batch_size {s.batch_size} / DP {world_size}). Nearest valid: "
            f"sft.micro_batch_size_per_gpu={_nearest(_divisors(per_rank), micro)}"
        )
    return UpdatePlan(
        role="sft",
        dp_size=world_size,
        sp_size=1,
        ppo_epochs=s.epochs,
        mini_batch_prompts=s.batch_size,
        mini_batch_samples=s.batch_size,
        mini_batches_per_epoch=0,
        optimizer_steps_per_step=1,
        mini_batch_samples_per_rank=per_rank,
        use_dynamic_bsz=False,
        micro_batch_size_per_rank=micro,
        grad_accum_steps=per_rank // micro,
        max_token_len_per_rank=None,
    )


def _check_step_rules(cfg: PostTrainConfig, world_size: int, uses_ref: bool, uses_critic: bool) -> None:
    """Rules 6-8 (groups need n >= 2, a forward holds every decoding sequence, FSDP groups divide the world)."""
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    est, n = cfg.algorithm.adv_estimator, cfg.rollout.n
    if estimator_needs(est).groups and n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={est} compares samples of the same prompt, so rollout.n ({n}) must be "
            f"at least 2 (typical: 4-16); with n=1 use reinforce_plus_plus, remax or gae"
        )
    ro = cfg.rollout
    if ro.max_num_batched_tokens < ro.max_num_seqs:
        raise ConfigError(
            f"rollout.max_num_batched_tokens ({ro.max_num_batched_tokens}) must be >= rollout.max_num_seqs "
            f"({ro.max_num_seqs}): each decoding sequence adds one token to every forward. Raise it to "
            f"rollout.max_num_batched_tokens={ro.max_num_seqs} or lower rollout.max_num_seqs"
        )
    for section, used in (("actor", True), ("ref", uses_ref), ("critic", uses_critic)):
        if used:
            key = f"{section}.fsdp_config.fsdp_size"
            fsdp_group_size(getattr(cfg, section).fsdp_config.fsdp_size, world_size, key)
    if distill_enabled(cfg.distill):
        fsdp_group_size(
            cfg.distill.teacher.fsdp_config.fsdp_size, world_size, "distill.teacher.fsdp_config.fsdp_size"
        )


OLD_LOG_PROB_SOURCES = ("recompute", "rollout", "update")


def old_log_prob_source(cfg: PostTrainConfig, actor: UpdatePlan) -> str:
    """Where the PPO ratio's old log-probs come from (a plan fact, shown by ``explain``):

    - ``"rollout"``: the engine's own log-probs (``algorithm.rollout_correction.bypass_mode``);
    - ``"update"``: no pass at all. When the samples feed exactly one optimizer step (one mini-batch, one
      epoch), the policy that would recompute them is the one the update starts from, so the update's own
      forward gives them (detached): the ratio is exactly 1, as TRL does. Only when nothing needs them before
      the update: no in-reward KL penalty, no importance weights or rejection from the rollout correction,
      and no distillation teacher (the OPD advantage is the teacher's minus the old policy's log-prob);
    - ``"recompute"``: a forward-only pass over the step's samples before the updates (verl's default).
    """
    rc = cfg.algorithm.rollout_correction
    if rc.bypass_mode:
        return "rollout"
    corrects = rc.rollout_is is not None or rc.rollout_rs is not None or rc.rollout_token_veto_threshold
    teacher = distill_enabled(cfg.distill)
    if (
        actor.optimizer_steps_per_step == 1
        and not cfg.algorithm.use_kl_in_reward
        and not corrects
        and not teacher
    ):
        return "update"
    return "recompute"


def build_plan(cfg: PostTrainConfig, world_size: int = 1) -> BatchPlan:
    """Derive the frozen BatchPlan; raises ConfigError on any inconsistent setting."""
    uses_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    uses_critic = estimator_needs(cfg.algorithm.adv_estimator).critic
    _check_step_rules(cfg, world_size, uses_ref, uses_critic)
    tbs, n = cfg.data.train_batch_size, cfg.rollout.n
    chunk = min(cfg.rollout.chunk_size, tbs)
    actor = _update_plan(cfg, "actor", world_size)
    plan = BatchPlan(
        world_size=world_size,
        prompts_per_step=tbs,
        n=n,
        samples_per_step=tbs * n,
        max_seq_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
        rollout_chunk_prompts=chunk,
        rollout_chunks_per_step=-(-tbs // chunk),
        actor=actor,
        old_log_prob=_forward_plan(cfg, "old_log_prob", world_size),
        ref=_forward_plan(cfg, "ref", world_size) if uses_ref else None,
        critic=_update_plan(cfg, "critic", world_size) if uses_critic else None,
        values=_forward_plan(cfg, "values", world_size) if uses_critic else None,
        reward_model=_forward_plan(cfg, "reward_model", world_size) if cfg.reward.model.enable else None,
        teacher=_forward_plan(cfg, "teacher", world_size) if distill_enabled(cfg.distill) else None,
        old_log_prob_source=old_log_prob_source(cfg, actor),
        rollout_staleness=cfg.async_training.max_staleness if cfg.async_training.enable else 0,
        partial_rollout_tokens=partial_rollout_tokens(cfg),
    )
    _check_shares(plan)
    return plan


def partial_rollout_tokens(cfg: PostTrainConfig) -> int:
    """P: the tokens per response a partial rollout generates ahead (`async_training.partial_rollout_tokens`;
    0 there: half of data.max_response_length); 0 without partial rollouts."""
    a = cfg.async_training
    if not (a.enable and a.partial_rollout):
        return 0
    return a.partial_rollout_tokens or max(1, cfg.data.max_response_length // 2)


def _check_shares(plan: BatchPlan) -> None:
    """Rule 9: every data-parallel share of a step holds at least one prompt group."""
    shares = plan.world_size // plan.share_replicas
    if plan.prompts_per_step < shares:
        raise ConfigError(
            f"data.train_batch_size ({plan.prompts_per_step}) must be at least the number of data-parallel ranks "
            f"({shares} = world {plan.world_size} / {plan.share_replicas} ranks per share): each keeps whole "
            f"prompt groups from the rollout to the update. Nearest valid: data.train_batch_size={shares}"
        )
