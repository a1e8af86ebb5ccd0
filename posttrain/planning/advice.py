"""What to change when the estimate says a phase will not fit, and where to start when nothing is measured.

Remedies are tried in the order the seeds give (verl's tuning guides): sequence parallelism for long context,
gradient checkpointing, the chunked log-prob head (the logits peak that checkpointing does not touch), offload,
and only then smaller micro-batches or token budgets (they cost throughput). Only keys that exist in the schema
are suggested; each candidate is checked with the batch plan and re-estimated before it is named.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from posttrain.config.load import all_keys, apply_values
from posttrain.config.plan import build_plan
from posttrain.config.schema import PostTrainConfig
from posttrain.planning.memory import Cluster, MemoryEstimate, estimate_memory
from posttrain.planning.memory_bytes import WhatIf
from posttrain.planning.shape import GIB, ModelShape

LONG_CONTEXT_TOKENS = 8192  # max_seq_len from which sequence parallelism is the first remedy (verl: > 8k-32k)


@dataclass(frozen=True)
class Advice:
    """A set of overrides (in the seeds' order of remedies) and the peak the estimator predicts with them."""

    overrides: dict[str, object]
    peak_bytes: int
    fits: bool
    reason: str  # the remedies applied, in order ("" when no config key helps)

    def as_args(self) -> str:
        return " ".join(
            f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.overrides.items()
        )


def _phase_role(phase: str) -> str:
    return "critic" if phase in ("critic_update", "values") else "actor"


def _remedies(cfg: PostTrainConfig, world: int, role: str, phase: str) -> list[tuple[str, dict[str, object]]]:
    keys = set(all_keys())
    out: list[tuple[str, dict[str, object]]] = []
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    sp_key = f"{role}.ulysses_sequence_parallel_size"
    if seq >= LONG_CONTEXT_TOKENS and sp_key in keys and phase != "rollout":
        for sp in (2, 4, 8):
            if world % sp == 0 and sp > getattr(getattr(cfg, role), "ulysses_sequence_parallel_size", 1):
                out.append((f"sequence parallelism {sp} (long context)", {sp_key: sp}))
                break
    gc_key = (
        "model.enable_gradient_checkpointing" if role == "actor" else "critic.enable_gradient_checkpointing"
    )
    if phase.endswith("_update") and gc_key in keys:
        out.append(("gradient checkpointing", {gc_key: True}))
    if role == "actor" and phase in ("actor_update", "old_log_prob"):
        chunk = {"actor.entropy_from_logits_with_chunking": True}
        if phase == "actor_update":
            chunk["actor.entropy_checkpointing"] = True
        out.append(("chunked log-prob head", chunk))
    if phase == "ref":
        out.append(("chunked log-prob head", {"ref.entropy_from_logits_with_chunking": True}))
    off_key = "model.enable_activation_offload" if role == "actor" else "critic.enable_activation_offload"
    if phase.endswith("_update") and off_key in keys:
        out.append(("activation offload (CUDA)", {off_key: True}))
    # Parameter/optimizer offload keys are suggested as soon as the schema has them (verl's names).
    for name in ("param_offload", "optimizer_offload"):
        for key in (f"{role}.fsdp_config.{name}", f"{role}.{name}", f"model.{name}"):
            if key in keys:
                out.append((name.replace("_", " "), {key: True}))
                break
    return [(label, {k: v for k, v in o.items() if k in keys}) for label, o in out]


def _try(cfg, overrides, shape, cluster, what_if) -> MemoryEstimate | None:
    try:
        new = apply_values(cfg, overrides)
        return estimate_memory(new, build_plan(new, cluster.world_size), shape, cluster, what_if)
    except ValueError:
        return None


def _smaller_batches(
    cfg, phase: str, limit: int, shape, cluster, what_if, base: dict
) -> dict[str, object] | None:
    """The largest micro-batch size / token budget (or rollout KV-cache slots) of ``phase`` that the estimate fits."""
    key, values = _batch_knob(cfg, phase, cluster.world_size)
    if key is None:
        return None
    for v in sorted(values, reverse=True):
        est = _try(cfg, {**base, key: v}, shape, cluster, what_if)
        if est is not None and est.phase(phase).total <= limit:
            return {key: v}
    return None


def _batch_knob(cfg: PostTrainConfig, phase: str, world: int) -> tuple[str | None, list[int]]:
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    budgets = [seq * k for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)]
    a, c = cfg.actor, cfg.critic
    if phase == "rollout":
        return "rollout.max_num_seqs", list(range(1, cfg.rollout.max_num_seqs))
    table: dict[str, tuple[bool, str, str, int]] = {
        "actor_update": (
            a.use_dynamic_bsz,
            "actor.ppo_max_token_len_per_gpu",
            "actor.ppo_micro_batch_size_per_gpu",
            a.ppo_micro_batch_size_per_gpu,
        ),
        "old_log_prob": (
            a.use_dynamic_bsz,
            "actor.log_prob_max_token_len_per_gpu",
            "actor.log_prob_micro_batch_size_per_gpu",
            a.log_prob_micro_batch_size_per_gpu,
        ),
        "ref": (
            cfg.ref.log_prob_use_dynamic_bsz,
            "ref.log_prob_max_token_len_per_gpu",
            "ref.log_prob_micro_batch_size_per_gpu",
            cfg.ref.log_prob_micro_batch_size_per_gpu,
        ),
        "critic_update": (
            c.use_dynamic_bsz,
            "critic.ppo_max_token_len_per_gpu",
            "critic.ppo_micro_batch_size_per_gpu",
            c.ppo_micro_batch_size_per_gpu,
        ),
        "values": (
            c.use_dynamic_bsz,
            "critic.forward_max_token_len_per_gpu",
            "critic.forward_micro_batch_size_per_gpu",
            c.forward_micro_batch_size_per_gpu,
        ),
    }
    if phase not in table:
        return None, []
    dynamic, budget_key, micro_key, micro = table[phase]
    if dynamic:
        section, name = budget_key.split(".")
        current = getattr(getattr(cfg, section), name)
        return budget_key, [b for b in budgets if b < current]
    return micro_key, list(range(1, micro))


def advise(
    cfg: PostTrainConfig,
    estimate: MemoryEstimate,
    shape: ModelShape,
    cluster: Cluster,
    what_if: WhatIf | None = None,
    headroom: float = 0.0,
) -> dict[str, Advice]:
    """For each phase predicted over ``gpu_memory_gb x (1 - headroom)``, the cheapest fix: remedies applied
    cumulatively in the seeds' order until the estimate fits, then the largest micro-batch/budget that fits."""
    if cluster.gpu_memory_gb is None:
        return {}
    limit = int(cluster.gpu_memory_gb * GIB * (1 - headroom))
    out: dict[str, Advice] = {}
    for phase in estimate.phases:
        if phase.total <= limit:
            continue
        name = phase.phase
        applied: dict[str, object] = {}
        labels: list[str] = []
        est: MemoryEstimate | None = estimate
        for label, overrides in _remedies(cfg, cluster.world_size, _phase_role(name), name):
            if not overrides:
                continue
            trial = _try(cfg, {**applied, **overrides}, shape, cluster, what_if)
            if trial is None or trial.phase(name).total >= est.phase(name).total:
                continue  # invalid with this world size, or it does not help this phase
            applied.update(overrides)
            labels.append(label)
            est = trial
            if trial.phase(name).total <= limit:
                break
        if est.phase(name).total > limit:
            smaller = _smaller_batches(cfg, name, limit, shape, cluster, what_if, applied)
            if smaller is not None:
                applied.update(smaller)
                labels.append(
                    "smaller token budget" if "max_token_len" in next(iter(smaller)) else "smaller batches"
                )
                est = _try(cfg, applied, shape, cluster, what_if) or est
        out[name] = Advice(applied, est.phase(name).total, est.phase(name).total <= limit, " + ".join(labels))
    return out


@dataclass(frozen=True)
class StartingPoint:
    """A starting configuration for a model-size tier, from the seeds' tables, in posttrain's units."""

    tier: str
    source: str
    overrides: dict[str, object]


# (largest parameter count of the tier, tier, seeds, train_batch_size prompts, n, mini-batch samples,
#  micro samples per GPU, trlx chunk_size prompts). SkyRL's policy_mini_batch_size counts samples: posttrain's
#  ppo_mini_batch_size counts prompts = samples / n (docs/batch-plan.md, "Translating a samples-based config").
_TIERS: tuple[tuple[float, str, str, int, int, int, int, int], ...] = (
    # Below 0.5B the seeds have no table. The tiny tier is posttrain's own CPU demo (README, measured); the
    # next one sits between it and the small tier (chunk size from trlx's 125M-1B row), not measured.
    (
        5.0e7,
        "tiny (under 50M, CPU-sized)",
        "posttrain's built-in CPU demo (measured, README)",
        32,
        8,
        128,
        64,
        64,
    ),
    (
        5.0e8,
        "sub-0.5B (50M-0.5B)",
        "between the built-in demo and the small tier; trlx 125M-1B chunk_size 128 (not measured)",
        128,
        8,
        128,
        8,
        128,
    ),
    (
        3.5e9,
        "small (0.5B-3B)",
        "SkyRL small model on 4 GPUs; trlx 125M-1B chunk_size 128",
        512,
        8,
        128,
        2,
        128,
    ),
    (2.0e10, "medium (7B-14B)", "SkyRL medium model on 8 GPUs; trlx 6B chunk_size 16", 256, 8, 64, 1, 16),
    (float("inf"), "large (20B-70B+)", "SkyRL 70B on 16 GPUs; trlx 20B chunk_size 4", 128, 4, 32, 1, 4),
)


def starting_point(shape: ModelShape, gradient_checkpointing_default: bool = True) -> StartingPoint:
    """The seeds' starting configuration for a model of this size (nothing measured), in posttrain's units.

    Forward-only micro-batches are 2x the training one (verl's tip); gradient checkpointing is on from the
    medium tier up (verl's first tip for larger micro-batches).
    """
    params = shape.num_params()
    row = next(t for t in _TIERS if params <= t[0])
    _, tier, source, tbs, n, mini_samples, micro, chunk = row
    overrides: dict[str, object] = {
        "data.train_batch_size": tbs,
        "rollout.n": n,
        "actor.ppo_mini_batch_size": mini_samples // n,
        "actor.ppo_micro_batch_size_per_gpu": micro,
        "actor.log_prob_micro_batch_size_per_gpu": 2 * micro,
        "ref.log_prob_micro_batch_size_per_gpu": 2 * micro,
        "rollout.chunk_size": chunk,
    }
    if gradient_checkpointing_default and params > 3.5e9:
        overrides["model.enable_gradient_checkpointing"] = True
    # Learning rates by size: tiny models need large steps (the demo's 2e-4), 0.5B+ models the seeds' 1e-6.
    overrides["actor.optim.lr"] = 2e-4 if params <= 5.0e7 else 1e-5 if params <= 5.0e8 else 1e-6
    return StartingPoint(tier, source, overrides)


def check_starting_point(
    point: StartingPoint, world_size: int, base: Callable[[], PostTrainConfig]
) -> str | None:
    """None when the starting point makes a valid plan at ``world_size``; else the plan's error message."""
    try:
        build_plan(apply_values(base(), point.overrides), world_size)
    except ValueError as err:
        return str(err)
    return None
