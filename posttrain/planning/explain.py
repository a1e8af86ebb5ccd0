"""Render a BatchPlan as a tree (the shape of SkyRL's batch diagram, filled in with real numbers)."""

from __future__ import annotations

from rich.table import Table
from rich.tree import Tree

from posttrain.config.plan import BatchPlan, ForwardPlan, UpdatePlan
from posttrain.config.schema import PostTrainConfig


def _micro_line(p: UpdatePlan, key_prefix: str) -> str:
    if p.use_dynamic_bsz:
        return (
            f"micro-batches by token budget: <= {p.max_token_len_per_rank} tokens per DP rank "
            f"({key_prefix}.ppo_max_token_len_per_gpu); count varies with lengths"
        )
    return (
        f"micro-batch {p.micro_batch_size_per_rank} samples per DP rank → "
        f"{p.grad_accum_steps} gradient-accumulation steps per mini-batch"
    )


def _update_branch(tree: Tree, p: UpdatePlan, title: str, key_prefix: str) -> None:
    node = tree.add(f"[bold]{title}[/] (DP {p.dp_size} = world / SP {p.sp_size})")
    node.add(
        f"mini-batch {p.mini_batch_prompts} prompts = {p.mini_batch_samples} samples "
        f"({key_prefix}.ppo_mini_batch_size)"
    )
    node.add(
        f"{p.mini_batches_per_epoch} mini-batches × ppo_epochs {p.ppo_epochs} = "
        f"[bold]{p.optimizer_steps_per_step} optimizer steps per step[/]"
    )
    node.add(f"per DP rank: {p.mini_batch_samples_per_rank} samples per mini-batch")
    node.add(_micro_line(p, key_prefix))


def _forward_branch(tree: Tree, p: ForwardPlan, title: str, key: str) -> None:
    if p.use_dynamic_bsz:
        how = f"token budget {p.max_token_len_per_rank} per pass ({key})"
    else:
        how = f"micro-batch {p.micro_batch_size_per_rank} samples → {p.passes_per_rank} passes per DP rank ({key})"
    tree.add(f"[bold]{title}[/] forward-only, DP {p.dp_size}: {p.samples_per_rank} samples per rank; {how}")


def weight_sync_line(cfg: PostTrainConfig, plan: BatchPlan) -> str:
    """How the rollout engine sees the actor's updates (the sync plan)."""
    r, lora = cfg.rollout, cfg.model.lora_rank > 0 or bool(cfg.model.lora_adapter_path)
    a = cfg.async_training
    if a.enable:
        where = (
            "the Ray-placed worker process" if a.rollout_worker == "ray" else "the rollout thread's engine"
        )
        merged = " (LoRA merged)" if lora else ""
        return (
            f"weight sync: after every update a snapshot of the weights{merged} is queued for {where}, which "
            "loads it after the rollouts queued before it"
        )
    if r.name == "native" and plan.world_size == 1:
        return "weight sync: none (the engine decodes with the actor's own module)"
    if r.name == "native":
        return "weight sync: after every update the sharded actor is gathered into each rank's engine copy"
    what = (
        "the LoRA adapter alone (model.lora_merge=false)"
        if lora and not cfg.model.lora_merge
        else ("the weights with LoRA merged" if lora else "every weight")
    )
    per = (
        "one decoder layer per bucket (rollout.layered_summon)" if r.layered_summon else "whole fused groups"
    )
    return (
        f"weight sync: after every update, {what} pushed into vLLM in buckets of ≤ "
        f"{r.update_weights_bucket_megabytes} MiB (rollout.update_weights_bucket_megabytes), {per}; prefix cache reset"
    )


def ray_ranks_line(cfg: PostTrainConfig) -> str:
    """Where the trainer ranks run when Ray places them (trainer.ray_ranks)."""
    t = cfg.trainer
    each = f"{t.ray_cpus_per_rank} CPU(s)" + (
        f" and {t.ray_gpus_per_rank} GPU" if t.ray_gpus_per_rank else ""
    )
    where = f"the Ray cluster at {t.ray_address}" if t.ray_address else "a Ray instance on this machine"
    return (
        f"[bold]trainer ranks[/]: {t.ray_ranks} processes placed by Ray (trainer.ray_ranks) on {where}, "
        f"{each} each, placement {t.ray_placement}; a failed rank restarts all of them from the last "
        f"checkpoint up to {t.ray_max_restarts} time(s) (trainer.ray_max_restarts)"
    )


OLD_LOG_PROB_LINES = {
    "rollout": "[bold]old log-probs[/]: the rollout engine's, no forward pass "
    "(algorithm.rollout_correction.bypass_mode)",
    "update": "[bold]old log-probs[/]: no forward pass: the samples feed one optimizer step, so the update's "
    "own forward is the old policy (ratio exactly 1). Set actor.ppo_mini_batch_size < data.train_batch_size, "
    "actor.ppo_epochs > 1, algorithm.use_kl_in_reward or a rollout correction to bring the pass back",
}


def plan_tree(cfg: PostTrainConfig, plan: BatchPlan) -> Tree:
    """A rich Tree of the plan, one branch per role, plus the derived facts users ask about."""
    root = Tree(
        f"[bold]data.train_batch_size {plan.prompts_per_step} prompts per step[/] "
        f"× rollout.n {plan.n} = [bold]{plan.samples_per_step} samples per step[/] "
        f"(world size {plan.world_size})"
    )
    rollout = root.add(
        f"[bold]rollout[/] ({cfg.rollout.name} engine): {plan.rollout_chunks_per_step} engine call(s) of "
        f"≤ {plan.rollout_chunk_prompts} prompts (rollout.chunk_size) × n {plan.n}; sequences ≤ {plan.max_seq_len} "
        f"tokens ({cfg.data.max_prompt_length} prompt + {cfg.data.max_response_length} response)"
        + (
            " (the multi-turn plan below counts a tool schema block on top)"
            if cfg.rollout.multi_turn.enable
            else ""
        )
    )
    rollout.add(weight_sync_line(cfg, plan))
    if cfg.trainer.ray_ranks:
        root.add(ray_ranks_line(cfg))
    _forward_branches(root, cfg, plan)
    if plan.critic is not None:
        _update_branch(root, plan.critic, "critic update", "critic")
    _update_branch(root, plan.actor, "actor update", "actor")
    _derived_facts(root.add("[bold]derived[/]"), cfg, plan)
    return root


def _forward_branches(root: Tree, cfg: PostTrainConfig, plan: BatchPlan) -> None:
    """One branch per forward pass the run makes, in the order the step runs them."""
    forward_passes = (
        (
            plan.old_log_prob,
            "old log-probs (actor)",
            "actor.log_prob_max_token_len_per_gpu",
            "actor.log_prob_micro_batch_size_per_gpu",
        ),
        (
            plan.ref,
            "reference log-probs",
            "ref.log_prob_max_token_len_per_gpu",
            "ref.log_prob_micro_batch_size_per_gpu",
        ),
        (
            plan.teacher,
            "teacher log-probs (distill.teacher)",
            "distill.teacher.log_prob_max_token_len_per_gpu",
            "distill.teacher.log_prob_micro_batch_size_per_gpu",
        ),
        (
            plan.values,
            "values (critic)",
            "critic.forward_max_token_len_per_gpu",
            "critic.forward_micro_batch_size_per_gpu",
        ),
        (
            plan.reward_model,
            "reward model",
            "reward.model.forward_max_token_len_per_gpu",
            "reward.model.micro_batch_size_per_gpu",
        ),
    )
    for p, title, budget_key, micro_key in forward_passes:
        if p is plan.old_log_prob and plan.old_log_prob_source != "recompute":
            root.add(OLD_LOG_PROB_LINES[plan.old_log_prob_source])
        elif p is plan.teacher and p is not None and cfg.distill.teacher.base_url:
            t = cfg.distill.teacher
            root.add(
                f"teacher log-probs (distill.teacher.base_url={t.base_url}): one request per sample, "
                f"{t.max_concurrency} at a time (distill.teacher.max_concurrency); no pass on the trainer"
            )
        elif p is not None:
            _forward_branch(root, p, title, budget_key if p.use_dynamic_bsz else micro_key)


def _derived_facts(facts: Tree, cfg: PostTrainConfig, plan: BatchPlan) -> None:
    """Optimizer steps, the prefix grouper's sharing and the policy lag: what follows from the sizes."""
    a = plan.actor
    facts.add(f"optimizer steps per rollout: {a.optimizer_steps_per_step}")
    if cfg.actor.use_prefix_grouper:
        facts.add(
            f"prefix grouper: each prompt runs once for its samples in a micro-batch, no padding"
            f"{_grouper_note(cfg, plan)} (actor.use_prefix_grouper, on by default with rollout.n > 1; false: "
            "verl's padded rows)"
        )
    if plan.rollout_staleness:
        k, steps = plan.rollout_staleness, a.optimizer_steps_per_step
        facts.add(
            f"rollouts ahead of training (async_training.max_staleness {k}): step s trains on samples of the "
            f"policy after step s-{k + 1}, {k} step(s) = {k * steps} optimizer step(s) older than the policy it "
            f"starts from; the lag is recorded per sample and corrected by algorithm.rollout_correction"
        )
    if plan.rollout_staleness is not None and cfg.async_training.enable:
        a = cfg.async_training
        if a.rollout_worker == "ray":
            devices = f"{a.rollout_num_cpus} CPU(s)" + (
                f" and {a.rollout_num_gpus} GPU(s)" if a.rollout_num_gpus else ""
            )
            ranks = (
                f"; it generates whole steps for rank 0, which sends each of the {plan.world_size} ranks its share"
                if plan.world_size > 1
                else ""
            )
            facts.add(
                f"rollout worker: a process of its own that Ray places on {devices} (async_training.rollout_worker"
                f"=ray); the trainer's devices hold no engine, and the weights travel to it after every update{ranks}"
            )
        else:
            facts.add(
                "rollout worker: a background thread of the trainer's process, sharing its devices (async_training"
                ".rollout_worker=thread; =ray gives it a process and devices of its own)"
            )
        if plan.partial_rollout_tokens:
            facts.add(
                f"partial rollouts: the first {plan.partial_rollout_tokens} token(s) of each response are generated ahead, the rest just "
                "before the step trains, with the newest weights (async_training.partial_rollout_tokens)"
            )
    if plan.max_policy_lag == 0:
        facts.add("fully on-policy: the single mini-batch is updated by the policy that generated it")
    elif not plan.rollout_staleness:
        facts.add(
            f"off-policy lag: mini-batch k of epoch e is updated by a policy e×{a.mini_batches_per_epoch}+k "
            f"optimizer steps newer than the rollout policy; the last one lags {plan.max_policy_lag} steps "
            f"(PPO's ratio clip corrects for this; ppo_mini_batch_size = train_batch_size removes it)"
        )


def _grouper_note(cfg: PostTrainConfig, plan: BatchPlan) -> str:
    """When the prefix grouper cannot share a prompt over all its samples, and why."""
    if cfg.actor.use_dynamic_bsz:
        return "; token-budget micro-batches pack whole prompt groups"
    split = [
        key
        for key in ("ppo_micro_batch_size_per_gpu", "log_prob_micro_batch_size_per_gpu")
        if getattr(cfg.actor, key) % plan.n
    ]
    if not split:
        return ""
    return (
        f"; actor.{' and actor.'.join(split)} not a multiple of rollout.n, so some prompts are split "
        "over micro-batches (exact, less saved)"
    )


def _count(n: int) -> str:
    return f"{n / 1e9:,.1f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M"


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f}"


STATES = ("weights", "optimizer")  # components that are model states (the rest is a phase's working memory)


def estimate_table(estimate, advice: dict | None = None):
    """A rich Table of the per-GPU memory estimate (one row per phase), with OOM warnings and fixes."""
    c = estimate.cluster
    limit = c.gpu_memory_gb
    m = estimate.model
    title = (
        f"Estimated peak memory per GPU (GiB): {m.name or 'model'}, {_count(m.num_params())} params, "
        f"{c.nodes} node(s) x {c.gpus_per_node} GPU(s)" + (f" x {limit:g} GiB" if limit else "")
    )
    table = Table(title=title, title_justify="left")
    table.add_column("phase")
    table.add_column("total", justify="right")
    table.add_column("components")
    table.add_column("fits?")
    for p in estimate.phases:
        parts = ", ".join(f"{x.name} {_gib(x.bytes)}" for x in p.components if x.bytes)
        fits = "-" if limit is None else ("yes" if p.total <= limit * 2**30 else "[bold red]NO (OOM)[/]")
        table.add_row(p.phase, _gib(p.total), parts, fits)
    # Where the model states sit (sharding, master weights, offload) is the same in every phase.
    placed = [
        f"{x.name}: {x.note}" for x in estimate.phases[0].components if x.note and x.name.endswith(STATES)
    ]
    if placed:
        table.caption, table.caption_justify = " | ".join(placed), "left"
    return table


def advice_lines(estimate, advice: dict) -> list[str]:
    """One warning per phase predicted over the GPU's memory, with the cheapest fix in the seeds' order."""
    lines = []
    limit = estimate.cluster.gpu_memory_gb
    for phase, a in advice.items():
        head = (
            f"[bold red]warning[/]: {phase} is predicted to need {_gib(estimate.phase(phase).total)} GiB per GPU, "
            f"more than the {limit:g} GiB a GPU has (out of memory)"
        )
        if a.fits:
            lines.append(f"{head}; cheapest fix ({a.reason}): {a.as_args()} -> {_gib(a.peak_bytes)} GiB")
            continue
        tail = (
            "the model states alone exceed the GPU: they need sharding or offload (<role>.fsdp_config.fsdp_size, "
            "param_offload, optimizer_offload under torchrun; LoRA: model.lora_rank), more GPUs, or GPUs with more "
            "memory"
        )
        copy = estimate.phase(phase).part("rollout weights")
        if copy * 2 > limit * 2**30:
            tail += (
                f"; note that {_gib(copy)} GiB of it is each GPU's unsharded rollout copy of the policy (the native "
                "engine decodes with a whole copy on every GPU), which no sharding key shrinks"
            )
        if a.overrides:
            lines.append(f"{head}; the config's knobs reach {_gib(a.peak_bytes)} GiB ({a.as_args()}); {tail}")
        else:
            lines.append(f"{head}; no config key fixes it: {tail}")
    return lines


def explain_json(plan, estimate, advice, point) -> dict:
    """`posttrain explain --json`: the plan's dict with the memory estimate, its advice and the starting point."""
    out = plan.to_dict()
    mem = None
    if estimate is not None:
        mem = estimate.to_dict()
        mem["advice"] = {
            k: {
                "overrides": a.overrides,
                "peak_gib": round(a.peak_bytes / 2**30, 3),
                "fits": a.fits,
                "reason": a.reason,
            }
            for k, a in advice.items()
        }
        if point is not None:
            mem["starting_point"] = {
                "tier": point.tier,
                "source": point.source,
                "overrides": point.overrides,
            }
    out["memory_estimate"] = mem
    return out
