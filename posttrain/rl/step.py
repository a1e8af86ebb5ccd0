"""One RL training step, phase by phase:

prompts → rollout → rewards → (engine cache released) → old log-probs → ref log-probs → values →
rollout-mismatch correction → advantages → critic update → actor update → rollout weights refreshed → metrics.

`train_step` only orders the phases; each phase function takes what it uses. With several data-parallel ranks
every phase works on this rank's share of the step (`posttrain.parallel.shares`); what must be global (the KL
controller's batch KL, whitening moments, counts, metrics) crosses ranks as sums and maxima of a few floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from posttrain.algorithms.advantages import AdvantageInputs, get_advantage_estimator
from posttrain.algorithms.distill import add_opd_advantage, distill_sums
from posttrain.algorithms.kl import KLController, apply_kl_penalty
from posttrain.algorithms.rollout_correction import compute_rollout_correction, rollout_correction_kwargs
from posttrain.config.plan import BatchPlan, ForwardPlan
from posttrain.config.schema import AlgorithmConfig, DistillConfig, RolloutCorrectionConfig
from posttrain.data.batch import RolloutBatch
from posttrain.forward.options import PassOptions
from posttrain.forward.passes import critic_values, policy_logprobs
from posttrain.forward.teacher import teacher_scores
from posttrain.parallel.data_parallel import DataParallel
from posttrain.parallel.shares import MAX, MEAN, MIN, SINGLE_SHARE, DataShare, ShareMetrics
from posttrain.rewards.judge import TIME as JUDGE_TIME
from posttrain.rl.build import Components
from posttrain.rl.collect.generation import (
    step_seed,
)
from posttrain.rl.collect.source import InlineRollouts, RolloutSource
from posttrain.rl.remote_teacher import RemoteTeacher
from posttrain.rl.teacher_routing import routed_teacher_scores, row_counts
from posttrain.train.losses import TeacherTerm, actor_loss_fn, critic_loss_fn
from posttrain.train.update import forward_in_micro_batches, run_update
from posttrain.utils.metrics import PhaseTimer


@dataclass(frozen=True)
class ForwardPasses:
    """Where and how the forward-only passes run: each pass's plan, options and data-parallel view."""

    plan: BatchPlan
    options: PassOptions
    parallel: dict[str, DataParallel]
    device: torch.device

    def run(self, role: str, fn, batch: RolloutBatch) -> torch.Tensor:
        """[B, R] ``fn`` over ``batch`` in the micro-batches the plan gives pass ``role``."""
        p: ForwardPlan = getattr(self.plan, role)
        budget = p.max_token_len_per_rank if p.use_dynamic_bsz else None
        return forward_in_micro_batches(
            fn, batch, p.micro_batch_size_per_rank, budget, self.device, self.parallel[role]
        )


def fill_forward_passes(
    batch: RolloutBatch,
    policy: nn.Module,
    ref: nn.Module | None,
    critic: nn.Module | None,
    passes: ForwardPasses,
    temperature: float,
    timer: PhaseTimer,
    teacher: nn.Module | RemoteTeacher | None = None,
    top_k: int = 0,
    routed: tuple[nn.Module, ...] = (),
) -> dict[str, torch.Tensor]:
    """Old log-probs (from where the plan says: recomputed, the rollout's, or left to the update's own
    forward), reference log-probs, the teacher's log-probs and values, each in its planned forward-only
    micro-batches. Returns what is not a batch field: the teacher's top-k membership (``in_top_k`` [B, R])."""
    opts = passes.options
    source = passes.plan.old_log_prob_source
    if source == "rollout":
        # The engine sampled with the actor's current weights: its log-probs are the old policy's.
        batch.old_log_probs = batch.rollout_log_probs
    elif source == "recompute":
        with timer.phase("old_log_prob"):
            policy.eval()
            batch.old_log_probs = passes.run(
                "old_log_prob",
                lambda mb: policy_logprobs(policy, mb, temperature=temperature, options=opts.old_log_prob)[0],
                batch,
            )
    # source == "update": the single optimizer step's forward is the old policy's (train.losses).
    if ref is not None:
        with timer.phase("ref"):
            batch.ref_log_probs = passes.run(
                "ref",
                lambda mb: policy_logprobs(ref, mb, temperature=temperature, options=opts.ref)[0],
                batch,
            )
    extra = {}
    if teacher is not None or routed:
        with timer.phase("teacher"):
            extra = teacher_pass(batch, passes, temperature, top_k, teacher, routed)
    if critic is not None:
        with timer.phase("values"):
            critic.eval()
            batch.values = passes.run("values", lambda mb: critic_values(critic, mb, opts.critic), batch)
    return extra


def teacher_pass(
    batch: RolloutBatch,
    passes: ForwardPasses,
    temperature: float,
    top_k: int,
    teacher: nn.Module | RemoteTeacher | None,
    routed: tuple[nn.Module, ...],
) -> dict[str, torch.Tensor]:
    """The teacher's log-probs into ``batch`` (``routed``: each of ``distill.teachers`` over its own rows; a
    remote teacher: from its server); returns ``in_top_k`` [B, R] when ``top_k``."""
    if isinstance(teacher, RemoteTeacher):  # no top-k: refused with a remote teacher (check_remote_teacher)
        batch.teacher_log_probs = teacher.scores(batch, temperature)
        return {}

    def score(module: nn.Module, rows: RolloutBatch) -> torch.Tensor:
        return passes.run(
            "teacher",
            lambda mb: teacher_scores(
                module, mb, temperature=temperature, top_k=top_k, options=passes.options.teacher
            ),
            rows,
        )

    if routed:
        if batch.teacher_ids is None:
            raise RuntimeError("distill.teachers is set but the batch carries no teacher_ids")
        columns = 2 if top_k else 0
        scores = routed_teacher_scores(
            batch, batch.teacher_ids, len(routed), lambda i, rows: score(routed[i], rows), columns
        )
    else:
        scores = score(teacher, batch)
    batch.teacher_log_probs = scores[..., 0] if top_k else scores
    if routed:  # a row without a teacher: teacher = student, so its OPD advantage is exactly 0
        none = batch.teacher_ids < 0
        batch.teacher_log_probs[none] = batch.old_log_probs[none].to(batch.teacher_log_probs.dtype)
    return {"in_top_k": scores[..., 1]} if top_k else {}


def correct_rollout_mismatch(
    batch: RolloutBatch, section: RolloutCorrectionConfig, share: DataShare = SINGLE_SHARE
) -> dict[str, float]:
    """Compare the rollout engine's log-probs with the trainer's old log-probs: mismatch metrics every step,
    and (when configured) truncated importance weights for the policy loss and rejection of outlier tokens or
    sequences (verl's `rollout_is` / `rollout_rs`). Nothing to do in bypass mode (they are the same), nor when
    the update computes the old log-probs itself (its loss reports the token-level mismatch metrics).

    Weights and masks are per token or per sequence: each rank computes its share's. The metrics are reduced
    over the shares (:func:`correction_reductions`)."""
    if batch.rollout_log_probs is None or batch.old_log_probs is None or section.bypass_mode:
        return {}
    tokens = float(batch.response_mask.sum())
    weights, mask, metrics = compute_rollout_correction(
        batch.old_log_probs,
        batch.rollout_log_probs,
        batch.response_mask,
        **rollout_correction_kwargs(section),
    )
    batch.rollout_is_weights = weights
    batch.response_mask = mask
    if not share.distributed:
        return metrics
    local = ShareMetrics()
    for name, value in metrics.items():
        how, per_token = correction_reductions(name, section)
        local.add({name: value}, how, weight=tokens if per_token else batch.num_rows)
    return share.reduce(local)


# Rollout-correction metrics that are means over response tokens besides the ``*_mean``, ``*_std`` and
# ``*_eff_sample_size`` statistics of token weights (the others average rows, or are extremes).
_TOKEN_MEANS = (
    "kl",
    "k3_kl",
    "chi2_token",
    "rollout_rs_masked_fraction",
    "rollout_is_catastrophic_token_fraction",
)


def correction_reductions(name: str, section: RolloutCorrectionConfig) -> tuple[str, bool]:
    """How a rollout-correction metric combines over shares: (max, min or mean; whether weighted by tokens,
    not rows). Means, fractions and extremes combine exactly; ``*_std``, ``*_eff_sample_size`` and ``*_seq_std``
    (nonlinear in the moments) are averaged with their moments' weights: close, not exact."""
    short = name.removeprefix("rollout_corr/")
    if short.endswith(("_max", "_max_deviation")):
        return MAX, False
    if short.endswith("_min"):
        return MIN, False
    if "_seq_" in short or short.startswith("seq_"):
        return MEAN, False
    if "ratio_fraction" in short:
        level = section.rollout_is if short.startswith("rollout_is") else section.rollout_rs
        return MEAN, level == "token"
    return MEAN, short in _TOKEN_MEANS or short.endswith(("_mean", "_std", "_eff_sample_size"))


def compute_advantages(
    batch: RolloutBatch,
    alg: AlgorithmConfig,
    kl_ctrl: KLController | None,
    share: DataShare = SINGLE_SHARE,
    distill: DistillConfig | None = None,
    in_top_k: torch.Tensor | None = None,
) -> dict[str, float]:
    """Token rewards (minus the in-reward KL penalty when on), then the configured estimator's advantages,
    then (with a teacher and ``distill.opd_coef`` > 0) the weighted OPD term added on trained tokens.

    On a share of the step: the controller sees the whole step's KL (one sum over ranks), and estimators with
    batch-wide statistics get ``batch_sum`` (groups are whole on every rank, so group statistics are local)."""
    metrics: dict[str, float] = {}
    if kl_ctrl is not None:
        batch.token_level_rewards, kl_metrics = apply_kl_penalty(
            batch.token_level_scores,
            batch.old_log_probs,
            batch.ref_log_probs,
            batch.response_mask,
            kl_ctrl,
            alg.kl_penalty,
        )
        kl, rows = kl_metrics["actor/reward_kl_penalty"], batch.num_rows
        if share.distributed:  # the mean over every rank's sequences
            kl_sum, rows = share.total([kl * rows, rows])
            kl_metrics["actor/reward_kl_penalty"] = kl = kl_sum / rows
        kl_ctrl.update(kl, n_steps=int(rows))
        metrics.update(kl_metrics)
    else:
        batch.token_level_rewards = batch.token_level_scores
    inputs = AdvantageInputs(
        token_level_rewards=batch.token_level_rewards,
        response_mask=batch.response_mask,
        group_ids=batch.group_ids,
        values=batch.values,
        reward_baselines=batch.reward_baselines,
        gamma=alg.gamma,
        lam=alg.lam,
        norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        batch_sum=share.batch_sum if share.distributed else None,
        teacher_log_probs=batch.teacher_log_probs,
        student_log_probs=batch.old_log_probs,
    )
    batch.advantages, batch.returns = get_advantage_estimator(alg.adv_estimator)(inputs)
    if batch.teacher_log_probs is not None and distill is not None:
        metrics.update(distill_advantages(batch, alg.adv_estimator, distill.opd_coef, share, in_top_k))
    return metrics


def distill_advantages(
    batch: RolloutBatch, estimator: str, coef: float, share: DataShare, in_top_k: torch.Tensor | None
) -> dict[str, float]:
    """Add ``coef`` x the OPD advantage to the estimator's (not for ``opd``, whose advantage it already is),
    and the ``distill/*`` metrics: per-token means over every rank's trained tokens. The student's log-probs
    are the old policy's (docs/distillation.md says why)."""
    teacher, student, mask = batch.teacher_log_probs, batch.old_log_probs, batch.response_mask
    if batch.teacher_ids is not None:  # rows without a teacher (distill.teachers): no OPD term, no metric
        mask = mask * (batch.teacher_ids >= 0).unsqueeze(-1).to(mask.dtype)
    if estimator != "opd":
        batch.advantages = add_opd_advantage(batch.advantages, teacher, student, mask, coef)
    weight = 1.0 if estimator == "opd" else coef
    sums = distill_sums(teacher, student, mask, in_top_k)
    names = sorted(k for k in sums if k != "tokens")
    tokens, *values = share.total([sums["tokens"], *(sums[k] for k in names)])
    tokens = max(tokens, 1.0)
    metrics = {f"distill/{k}": v / tokens for k, v in zip(names, values)}
    metrics["distill/advantage_mean"] = -weight * metrics["distill/reverse_kl"]
    return metrics


def update_phase(
    run: Components, batch: RolloutBatch, step: int, temperature: float, timer: PhaseTimer
) -> dict:
    """The critic's update (when there is one), then the actor's (after the critic's warm-up steps). Both draw
    their mini-batch shuffles from one per-step generator, in that order."""
    cfg, metrics = run.cfg, {}
    gen = torch.Generator().manual_seed(step_seed(cfg.trainer.seed, step, salt=1))
    roles = []
    gkd = None
    if run.teacher is not None and cfg.distill.gkd_coef > 0:
        gkd = TeacherTerm(run.teacher, run.forward.teacher, cfg.distill)
    if run.critic is not None:
        roles.append(
            ("critic", run.critic, critic_loss_fn(run.critic.module, cfg.critic, run.forward.critic))
        )
    if run.critic is None or step > cfg.critic.warmup_steps:
        roles.append(
            (
                "actor",
                run.actor,
                actor_loss_fn(run.actor.module, cfg.actor, temperature, run.forward.actor, gkd),
            )
        )
    for role, trainable, loss_fn in roles:
        with timer.phase(f"update_{role}"):
            metrics.update(
                run_update(
                    trainable,
                    batch,
                    getattr(run.plan, role),
                    loss_fn,
                    shuffle=getattr(cfg, role).shuffle,
                    norm_constant=float(cfg.data.max_response_length),
                    generator=gen,
                    prefix=role,
                    dp=run.dp(role),
                )
            )
    return metrics


def train_step(
    run: Components, step: int, timer: PhaseTimer, source: RolloutSource | None = None
) -> dict[str, float]:
    """Run one step (1-based `step`) and return its metrics. The samples come from ``source``: collected now
    (the default, :class:`InlineRollouts`), or generated ahead of training (`async_training.enable`)."""
    cfg = run.cfg
    if source is None:
        source = inline_rollouts(run)
    batch, metrics = source.take(step, timer)
    temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
    critic = run.critic.module if run.critic is not None else None
    passes = ForwardPasses(run.plan, run.forward, run.parallel, run.device)
    extra = fill_forward_passes(
        batch,
        run.actor.module,
        run.ref,
        critic,
        passes,
        temperature,
        timer,
        run.teacher,
        cfg.distill.top_k,
        run.routed_teachers,
    )
    if run.teacher_route is not None:
        metrics.update(row_counts(run.teacher_route, batch.teacher_ids))
    if isinstance(run.teacher, RemoteTeacher):  # each rank asked for its own samples: the counts add up
        counts = run.teacher.metrics()
        metrics.update(zip(counts, run.share.total(list(counts.values()))))
    with timer.phase("advantage"):
        metrics.update(
            compute_advantages(
                batch, cfg.algorithm, run.kl_ctrl, run.share, cfg.distill, extra.get("in_top_k")
            )
        )
        # After the advantages: rejected tokens leave the loss, not the group statistics.
        metrics.update(correct_rollout_mismatch(batch, cfg.algorithm.rollout_correction, run.share))
    metrics.update(update_phase(run, batch, step, temperature, timer))
    with timer.phase("sync_weights"):
        metrics.update(source.push(step, run.actor.module))
    tokens = run.share.total([float(batch.attention_mask.sum())])[0]
    metrics.update(timer.pop())
    # timing/judge is part of timing/rollout (the judge scores inside the rollout phase): not added twice
    step_time = sum(v for k, v in metrics.items() if k.startswith("timing/") and k != JUDGE_TIME)
    metrics["timing/step"] = step_time
    metrics["perf/tokens_per_s"] = tokens / max(step_time, 1e-9)
    return metrics


def inline_rollouts(run: Components) -> InlineRollouts:
    """The run's own rollouts, collected when each step asks (rollout and training alternate)."""
    return InlineRollouts(run, run.rollout_weights)
