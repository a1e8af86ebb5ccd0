"""Per-GPU peak memory of each phase of an RL step, estimated from the config, the model shape and the cluster.

No GPU is needed. Every formula is a small function below whose docstring says what it models and what it
ignores; :func:`estimate_memory` adds them up phase by phase. Sizes are bytes unless a name says otherwise.

The config is read as the trainer applies it at the cluster's world size (:func:`role_placement`):

* One GPU: every role's weights and optimizer states whole on the device for the whole step; the rollout engine
  shares the actor's module. Parameters, gradients and AdamW's two moments are in ``model.dtype``.
* Several GPUs (``torchrun``): each role is sharded with FSDP2 as its ``<role>.fsdp_config`` says (``fsdp_size``
  -1: over all GPUs; k: HSDP groups of k), ``param_offload`` keeps parameters, gradients and optimizer states in
  CPU memory, and with a 16-bit ``model.dtype`` the actor and reference keep fp32 master weights (FSDP2 mixed
  precision; the critic is loaded in ``model.dtype``). Every rank also holds an unsharded ``model.dtype`` copy
  of the policy for its rollout engine.
* ``optimizer_offload`` (one GPU or several): AdamW's moments wait in CPU memory and come back for the step.
* LoRA (``model.lora_rank``): only the adapters get gradients and AdamW states, all in fp32 (PEFT keeps adapters
  fp32 on a bf16/fp16 base, so no master copy), and a LoRA actor's reference policy is the actor itself with
  adapters disabled: no reference weights.
* A distillation teacher (``distill.teacher.path``): its own shape (read from its config.json; the student's
  when it cannot be read) in ``distill.teacher.dtype``, sharded as ``distill.teacher.fsdp_config`` says, resident
  for the whole step like the reference, and its forward pass.

:class:`WhatIf` replaces any of these for every role ("what would it give"). The rollout phase models the
configured engine (``rollout.name``): the native engine's slot cache, or vLLM's reservation of
``gpu_memory_utilization`` of the GPU (weights + KV cache, ``max_num_seqs``, ``tensor_model_parallel_size``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from posttrain.config.plan import BatchPlan, ForwardPlan, UpdatePlan, fsdp_group_size
from posttrain.config.schema import PostTrainConfig
from posttrain.config.schema.distill import teacher_head_chunk
from posttrain.planning.memory_bytes import (
    DTYPE_BYTES,
    FP32,
    FULL,
    Training,
    WhatIf,
    forward_only_bytes,
    gradient_bytes,
    head_update_bytes,
    narrowed_last_mlp_bytes,
    native_rollout_bytes,
    optimizer_bytes,
    parameter_bytes,
    role_training,
    trainable_params,
    update_activation_bytes,
    update_step_bytes,
    vllm_rollout,
)
from posttrain.planning.shape import GIB, ModelShape, teacher_shape


@dataclass(frozen=True)
class Cluster:
    """The machines: ``nodes`` x ``gpus_per_node`` GPUs of ``gpu_memory_gb`` GiB each (None: unknown)."""

    nodes: int = 1
    gpus_per_node: int = 1
    gpu_memory_gb: float | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Placement:
    """Where one role's model states sit on each GPU."""

    shard: int = 1  # GPUs sharing one copy (the FSDP group); 1: whole on every GPU
    param_offload: bool = False  # parameters, gradients and optimizer states in CPU memory
    optimizer_offload: bool = False  # optimizer states in CPU memory except during the optimizer step
    master_fp32: bool = (
        False  # fp32 parameters (the master copy the optimizer updates), compute in model.dtype
    )


ROLE_SECTIONS = {"actor": "actor", "reference": "ref", "critic": "critic", "teacher": "distill.teacher"}


def teacher_paths(cfg: PostTrainConfig) -> dict[str, str]:
    """Each teacher's weights component name and path: ``distill.teacher.path`` ("teacher weights") and
    each ``distill.teachers`` entry ("teacher weights (SOURCE)")."""
    out = {"teacher weights": cfg.distill.teacher.path} if cfg.distill.teacher.path else {}
    out.update({f"teacher weights ({source})": path for source, path in cfg.distill.teachers.items()})
    return out


def role_placement(cfg: PostTrainConfig, world_size: int, w: WhatIf, role: str) -> Placement:
    """The role's ``fsdp_config`` as the trainer applies it at ``world_size`` GPUs; a ``WhatIf`` value wins.

    One process shards nothing and cannot offload parameters (FSDP2 does that); optimizer offload works on one
    GPU too. Sharded with a 16-bit ``model.dtype``, the actor (and the reference, copied from it) keep fp32
    master weights; the critic is loaded in ``model.dtype``.
    """
    section = ROLE_SECTIONS[role]
    fsdp = cfg
    for part in f"{section}.fsdp_config".split("."):
        fsdp = getattr(fsdp, part)
    sharded = world_size > 1
    shard = fsdp_group_size(fsdp.fsdp_size, world_size, f"{section}.fsdp_config.fsdp_size") if sharded else 1
    master = sharded and cfg.model.dtype != "fp32" and role not in ("critic", "teacher")

    def pick(what_if: object, from_config: object):
        return from_config if what_if is None else what_if

    return Placement(
        shard=pick(w.fsdp_size, shard),
        param_offload=pick(w.param_offload, sharded and fsdp.param_offload),
        optimizer_offload=pick(w.optimizer_offload, getattr(fsdp, "optimizer_offload", False)),
        master_fp32=pick(w.master_weights_fp32, master),
    )


@dataclass(frozen=True)
class Component:
    """One named share of a phase's peak."""

    name: str
    bytes: int
    note: str = ""


@dataclass(frozen=True)
class PhaseEstimate:
    """The per-GPU peak of one phase: resident model states + the phase's own working memory."""

    phase: str
    components: tuple[Component, ...]
    detail: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(c.bytes for c in self.components)

    def part(self, name: str) -> int:
        return sum(c.bytes for c in self.components if c.name == name)


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU estimates of every phase of a step. ``to_dict()`` is the ``memory_estimate`` JSON object."""

    model: ModelShape
    cluster: Cluster
    what_if: WhatIf
    phases: tuple[PhaseEstimate, ...]

    @property
    def peak(self) -> PhaseEstimate:
        return max(self.phases, key=lambda p: p.total)

    def phase(self, name: str) -> PhaseEstimate:
        for p in self.phases:
            if p.phase == name:
                return p
        raise KeyError(
            f"no {name!r} phase in this estimate (phases: {', '.join(p.phase for p in self.phases)})"
        )

    def to_dict(self) -> dict:
        limit = self.cluster.gpu_memory_gb
        return {
            "model": dataclasses.asdict(self.model) | {"num_params": self.model.num_params()},
            "cluster": dataclasses.asdict(self.cluster) | {"world_size": self.cluster.world_size},
            "what_if": dataclasses.asdict(self.what_if),
            "phases": {
                p.phase: {
                    "total_gib": round(p.total / GIB, 3),
                    "fits": None if limit is None else p.total <= limit * GIB,
                    "components_gib": {c.name: round(c.bytes / GIB, 3) for c in p.components},
                    **p.detail,
                }
                for p in self.phases
            },
            "peak_phase": self.peak.phase,
            "peak_gib": round(self.peak.total / GIB, 3),
        }


# --- assembling the phases ------------------------------------------------------------------------------------


def prompts_per_micro_batch(samples: int, n: int) -> int:
    """Most prompts that ``samples`` consecutive samples touch when samples are prompt-major (``n`` per prompt)
    and micro-batches start at multiples of ``samples``."""
    period = n // math.gcd(samples, n)  # micro-batch starts repeat modulo n with this period
    return max((j * samples + samples - 1) // n - (j * samples) // n + 1 for j in range(period))


def micro_batch_tokens(
    use_dynamic_bsz: bool,
    micro: int | None,
    budget: int | None,
    prompt_len: int,
    response_len: int,
    sp: int,
    group_size: int = 0,
) -> tuple[int, int]:
    """(tokens, response tokens) of the largest micro-batch on one GPU.

    Fixed micro-batches: ``micro`` samples at the longest possible length (prompt + response; padding to the
    longest row makes this the worst case with or without packing). Token budget: ``budget`` tokens, of which
    the response share is that of max-length samples. Ulysses SP splits every sequence over ``sp`` GPUs.
    ``group_size`` > 0 (the prefix grouper, ``rollout.n`` samples per prompt): a fixed micro-batch computes each
    of its prompts once; a token budget still caps the plain tokens, so it stays the bound.
    """
    seq = prompt_len + response_len
    if use_dynamic_bsz:
        tokens = int(budget or seq)
        response = tokens * response_len // seq
    else:
        samples = int(micro or 1)
        prompts = prompts_per_micro_batch(samples, group_size) if group_size else samples
        tokens, response = prompts * prompt_len + samples * response_len, samples * response_len
    return -(-tokens // sp), -(-response // sp)


def prefix_mask_bytes(response_tokens: int, prompt_len: int, response_len: int) -> int:
    """The prefix grouper's boolean attention mask (:mod:`posttrain.forward.shared_prefix`): one byte per (query,
    key) cell of each response, ``R x (P + R)`` for a response padded to ``R`` reading its prompt padded to ``P``;
    for max-length samples that is ``response_tokens x (P + R)`` (the prompts' own attention needs no mask)."""
    return response_tokens * (prompt_len + response_len)


def _group_size(cfg: PostTrainConfig, plan: BatchPlan, role: str) -> int:
    """``rollout.n`` where the prefix grouper computes this role's passes (actor update, old and reference
    log-probs), else 0."""
    grouped = cfg.ref.use_prefix_grouper if role == "ref" else cfg.actor.use_prefix_grouper
    if role == "teacher":  # the teacher pass groups as the actor does, unless it packs
        grouped = grouped and not cfg.distill.teacher.use_remove_padding
    return plan.n if grouped and role in ("actor", "old_log_prob", "ref", "teacher") else 0


def _flag(section: object, name: str) -> bool:
    # Keys added by other work items are read by their documented names when present (False otherwise).
    return bool(getattr(section, name, False))


def _head_chunk(section: object) -> int | None:
    if not _flag(section, "entropy_from_logits_with_chunking"):
        return None
    return int(getattr(section, "entropy_from_logits_chunk_size", 2048))


def _critic_params(shape: ModelShape) -> ModelShape:
    # The critic is the backbone without the LM head (+ a [H, 1] value head, negligible): an untied head's
    # V x H weights are not there; with tied embeddings the matrix stays as the input embedding.
    return dataclasses.replace(shape, tie_word_embeddings=True)


def _states(
    cfg: PostTrainConfig, shape: ModelShape, place: Placement, t: Training, trained: bool
) -> tuple[int, int, int]:
    """(weights, optimizer states, gradients) of one role on one GPU, where they sit for the whole step (the
    optimizer's when not offloaded; the gradients only during the update)."""
    b = DTYPE_BYTES[cfg.model.dtype]
    keep = FP32 if place.master_fp32 else b
    weights = parameter_bytes(shape, keep, place.shard, place.param_offload, b)
    if not trained:
        return weights, 0, 0
    on_cpu = place.param_offload
    if t.lora_rank == 0:
        n, state = shape.num_params(), keep
    else:  # the adapters: fp32 parameters, gradients and moments on the frozen base
        n, state = trainable_params(shape, t.lora_rank, t.target_modules), FP32
        weights += 0 if on_cpu else n * FP32 // place.shard
    return weights, optimizer_bytes(n, state, place.shard), gradient_bytes(n, state, place.shard, on_cpu)


def _resident(
    cfg: PostTrainConfig, plan: BatchPlan, shape: ModelShape, cluster: Cluster, w: WhatIf
) -> list[Component]:
    """Model states that stay on each GPU for the whole step."""
    out: list[Component] = []
    actor_lora = role_training(cfg, w, "actor").lora_rank > 0
    roles = [("actor", shape, True)]
    if plan.ref is not None and not actor_lora:  # a LoRA actor is its own reference (adapters disabled)
        roles.append(("reference", shape, False))
    if plan.critic is not None:
        roles.append(("critic", _critic_params(shape), True))
    for name, s, trained in roles:
        place = role_placement(cfg, cluster.world_size, w, name)
        t = role_training(cfg, w, name) if trained else FULL
        weights, optimizer, _ = _states(cfg, s, place, t, trained)
        note = []
        if place.shard > 1:
            note.append(f"sharded over {place.shard} GPUs")
        if place.master_fp32:
            note.append("fp32 master weights")
        if place.param_offload:
            note.append("parameters in CPU memory")
        if t.lora_rank > 0:
            note.append(
                f"frozen base + {trainable_params(s, t.lora_rank, t.target_modules):,} fp32 LoRA adapter parameters"
            )
            if name == "actor" and plan.ref is not None:
                note.append("also the reference policy (adapters disabled)")
        out.append(Component(f"{name} weights", weights, "; ".join(note)))
        if trained:
            moved = place.param_offload or place.optimizer_offload
            where = ["of the LoRA adapters"] if t.lora_rank > 0 else []
            where += ["in CPU memory between steps"] if moved else []
            out.append(Component(f"{name} optimizer", 0 if moved else optimizer, "; ".join(where)))
    if plan.teacher is not None:
        place = role_placement(cfg, cluster.world_size, w, "teacher")
        b = DTYPE_BYTES[cfg.distill.teacher.dtype or cfg.model.dtype]
        note = [f"sharded over {place.shard} GPUs"] if place.shard > 1 else []
        note += ["parameters in CPU memory"] if place.param_offload else []
        for name, path in teacher_paths(cfg).items():  # every teacher stays resident
            weights = parameter_bytes(teacher_shape(path) or shape, b, place.shard, place.param_offload, b)
            out.append(Component(name, weights, "; ".join(note)))
    remote = remote_rollout(cfg)
    if (cluster.world_size > 1 or cfg.async_training.enable) and w.rollout_engine == "native" and not remote:
        # Each rank's engine decodes with a plain copy of the policy, refreshed after every update (one rank:
        # only when it samples ahead of training, which must not see the weights change under it).
        b = DTYPE_BYTES[cfg.model.dtype]
        out.append(Component("rollout weights", shape.num_params() * b, "each GPU's unsharded engine copy"))
    return out


def _micro_batch(cfg: PostTrainConfig, plan: BatchPlan, p: UpdatePlan | ForwardPlan) -> tuple[int, int, int]:
    """(tokens, response tokens, prefix-grouper mask bytes) of this pass's largest micro-batch on one GPU."""
    d, group = cfg.data, _group_size(cfg, plan, p.role)
    tokens, resp = micro_batch_tokens(
        p.use_dynamic_bsz,
        p.micro_batch_size_per_rank,
        p.max_token_len_per_rank,
        d.max_prompt_length,
        d.max_response_length,
        p.sp_size,
        group,
    )
    mask = prefix_mask_bytes(resp, d.max_prompt_length, d.max_response_length) if group else 0
    return tokens, resp, mask


def _update_phase(
    cfg: PostTrainConfig,
    plan: BatchPlan,
    p: UpdatePlan,
    shape: ModelShape,
    cluster: Cluster,
    w: WhatIf,
    resident: list[Component],
) -> PhaseEstimate:
    b = DTYPE_BYTES[cfg.model.dtype]
    actor = p.role == "actor"
    section = cfg.actor if actor else cfg.critic
    ckpt_section = cfg.model if actor else cfg.critic
    tokens, resp, mask = _micro_batch(cfg, plan, p)
    s = shape if actor else _critic_params(shape)
    t = role_training(cfg, w, p.role)
    place = role_placement(cfg, cluster.world_size, w, p.role)
    _, optimizer, grads = _states(cfg, s, place, t, trained=True)
    step_optimizer = optimizer if place.optimizer_offload and not place.param_offload else 0
    gc = _flag(ckpt_section, "enable_gradient_checkpointing")
    offload = _flag(ckpt_section, "enable_activation_offload")
    acts = update_activation_bytes(shape, tokens, b, gc, offload, t)
    # The padded forward (not packed, grouped or split over SP ranks) narrows its last MLP; checkpointing
    # recomputes the whole layer, and offloaded activations are not on the device anyway.
    padded = not _flag(cfg.model if actor else cfg.critic, "use_remove_padding") and not mask
    if padded and p.sp_size == 1 and not gc and not offload:
        acts -= narrowed_last_mlp_bytes(shape, tokens, resp, b)
    note = f"max(activations {acts / GIB:.2f} GiB, gradients {grads / GIB:.2f} GiB"
    note += f" + optimizer states for the step {step_optimizer / GIB:.2f} GiB)" if step_optimizer else ")"
    comps = [
        *resident,
        Component("gradients/activations", update_step_bytes(acts, grads, step_optimizer), note),
    ]
    if actor:
        head = head_update_bytes(
            resp, shape.vocab_size, b, _head_chunk(section), _flag(section, "entropy_checkpointing")
        )
        comps.append(Component("log-prob/entropy head", head))
    if mask:
        comps.append(Component("prefix-grouper mask", mask))
    detail = {
        "micro_batch_tokens": tokens,
        "activations_gib": round(acts / GIB, 3),
        "gradients_gib": round(grads / GIB, 3),
    }
    return PhaseEstimate(f"{p.role}_update", tuple(comps), detail)


def _forward_phase(
    cfg: PostTrainConfig,
    plan: BatchPlan,
    p: ForwardPlan,
    shape: ModelShape,
    resident: list[Component],
    chunk: int | None,
) -> PhaseEstimate:
    tokens, resp, mask = _micro_batch(cfg, plan, p)
    work = forward_only_bytes(shape, tokens, resp, DTYPE_BYTES[cfg.model.dtype], chunk, p.role != "values")
    comps = [*resident, Component("forward working memory", work)]
    if mask:
        comps.append(Component("prefix-grouper mask", mask))
    return PhaseEstimate(p.role, tuple(comps), {"micro_batch_tokens": tokens})


def remote_rollout(cfg: PostTrainConfig) -> bool:
    """The rollout runs in a worker process on devices of its own (async_training.rollout_worker=ray)."""
    return cfg.async_training.enable and cfg.async_training.rollout_worker == "ray"


def _rollout_phase(
    cfg: PostTrainConfig,
    plan: BatchPlan,
    shape: ModelShape,
    cluster: Cluster,
    w: WhatIf,
    resident: list[Component],
) -> PhaseEstimate:
    b = DTYPE_BYTES[cfg.model.dtype]
    if w.rollout_engine == "vllm":
        gpu = int((cluster.gpu_memory_gb or 80) * GIB)
        v = vllm_rollout(shape, gpu, w, plan.max_seq_len, b)
        comps = (*resident, Component("vLLM reservation", v["reserved_bytes"], "weights + KV cache"))
        detail = {
            "vllm_max_concurrent_seqs": v["max_concurrent_seqs"],
            "vllm_kv_cache_gib": round(v["kv_cache_bytes"] / GIB, 3),
        }
        return PhaseEstimate("rollout", comps, detail)
    r = cfg.rollout
    kv, work = native_rollout_bytes(shape, r.max_num_seqs, plan.max_seq_len, r.max_num_batched_tokens, b)
    comps = (
        *resident,
        Component("KV cache", kv, f"{r.max_num_seqs} slots x {plan.max_seq_len} tokens"),
        Component("forward + sampling", work, f"{r.max_num_batched_tokens} tokens per forward"),
    )
    return PhaseEstimate("rollout", comps, {"kv_cache_slots": r.max_num_seqs})


def estimate_memory(
    cfg: PostTrainConfig,
    plan: BatchPlan,
    shape: ModelShape,
    cluster: Cluster | None = None,
    what_if: WhatIf | None = None,
) -> MemoryEstimate:
    """Per-GPU peak memory of every phase of one RL step (rollout, forward passes, updates).

    Each phase's peak = the model states resident on the GPU for the whole step + the phase's working memory.
    The plan's per-rank micro-batch sizes and token budgets are used as they are (they are already per GPU).
    """
    cluster = cluster or Cluster()
    w = what_if or WhatIf()
    resident = _resident(cfg, plan, shape, cluster, w)
    if remote_rollout(cfg):
        # The rollout worker has devices of its own: its phase is counted there, none of it on the trainer's.
        copy = Component(
            "rollout weights",
            shape.num_params() * DTYPE_BYTES[cfg.model.dtype],
            "the worker's own copy, on its device",
        )
        phases = [_rollout_phase(cfg, plan, shape, cluster, w, [] if w.rollout_engine == "vllm" else [copy])]
    else:
        phases = [_rollout_phase(cfg, plan, shape, cluster, w, resident)]
    if (plan.rollout_staleness or cfg.async_training.enable) and not remote_rollout(cfg):
        # The background rollout generates while every other phase runs: its memory is there too.
        resident = [
            *resident,
            *(
                Component(f"{c.name} (rollout ahead)", c.bytes, "the background rollout runs meanwhile")
                for c in phases[0].components
                if c not in resident
            ),
        ]
    if plan.old_log_prob_source == "recompute":  # otherwise no pass runs (bypass mode, or the update's own)
        phases.append(_forward_phase(cfg, plan, plan.old_log_prob, shape, resident, _head_chunk(cfg.actor)))
    if plan.ref is not None:
        phases.append(_forward_phase(cfg, plan, plan.ref, shape, resident, _head_chunk(cfg.ref)))
    if plan.teacher is not None and teacher_paths(cfg):  # a remote teacher (base_url) runs no pass here
        shapes = [teacher_shape(p) or shape for p in teacher_paths(cfg).values()]
        tshape = max(shapes, key=lambda s: s.num_params())  # one teacher's pass at a time: the largest's
        chunk = teacher_head_chunk(cfg.distill.teacher, cfg.ref)
        phases.append(_forward_phase(cfg, plan, plan.teacher, tshape, resident, chunk))
    if plan.values is not None:
        phases.append(_forward_phase(cfg, plan, plan.values, shape, resident, None))
    if plan.critic is not None:
        phases.append(_update_phase(cfg, plan, plan.critic, shape, cluster, w, resident))
    phases.append(_update_phase(cfg, plan, plan.actor, shape, cluster, w, resident))
    return MemoryEstimate(shape, cluster, w, tuple(phases))
