"""The rollout phase of a step: draw the step's prompts, generate and score this rank's share of them, and lay
the samples out as a scored RolloutBatch; and validation on the rollout's context. Synchronous: the same
functions run inline (``posttrain.rl.collect.source``) or on a rollout worker ahead of training
(``posttrain.rl.overlap``)."""

from __future__ import annotations

import torch

from posttrain.algorithms.advantages import estimator_needs
from posttrain.config.schema import PostTrainConfig
from posttrain.data.batch import RolloutBatch
from posttrain.parallel.shares import MAX, MEAN, SINGLE_SHARE, SUM, ShareMetrics, select_share
from posttrain.rewards.combine import RewardWeights
from posttrain.rewards.many import declares_samples_at_once
from posttrain.rewards.overlong import overlong_metrics
from posttrain.rl.collect.context import RolloutContext
from posttrain.rl.collect.generation import (
    Scored,
    Scorer,
    greedy_baselines,
    has_rollout_log_probs,
    overlong_shaping,
    rollout_metrics,
    scored_batch,
    step_seed,
    training_params,
)
from posttrain.rl.collect.group_filter import ScoredGroups, draw_groups, generation_salt, group_filter
from posttrain.rl.collect.multi_turn import (
    check_not_all_failed,
    episode_metrics,
    logged_tool_names,
    step_metric_keys,
)
from posttrain.rl.collect.truncation import mask_truncated
from posttrain.rl.collect.validation import validate
from posttrain.rollout.base import SamplingParams
from posttrain.utils.metrics import PhaseTimer


def rollout_phase(
    context: RolloutContext, step: int, timer: PhaseTimer
) -> tuple[RolloutBatch, dict[str, float]]:
    """Sample this step's prompts, generate and score this rank's share of them, and lay its samples out as a
    batch (with several ranks: the share, carrying the step's groups). With DAPO's group filter the whole step
    is drawn and filtered on every rank, then cut to the share. The engine's cache memory is held for this
    phase only."""
    cfg = context.cfg
    scorer = context_scorer(context)
    flt = group_filter(cfg)
    with timer.phase("rollout"):
        context.engine.wake_up()

        def params(k: int) -> SamplingParams:  # generation batch k (several with algorithm.filter_groups)
            return training_params(cfg, step_seed(cfg.trainer.seed, step, generation_salt(k)))

        drawn, local = draw_groups(
            context.engine,
            scorer,
            context.train_prompts,
            context.sampler,
            params,
            flt,
            context.dist,
            context.share,
            context.agent,
        )
        baselines = context_baselines(context, scorer, drawn.rows)
        engine_metrics = context.engine.generation_metrics()
        context.engine.release_memory()  # the forward and update phases need the memory more
    return assemble_rollout(context, drawn, local, baselines, engine_metrics)


def context_scorer(context: RolloutContext) -> Scorer:
    """The rollout's scorer: the reward function or rule, the reward model, DAPO's overlong shaping."""
    rm = context.reward_model
    weights = RewardWeights.from_config(context.cfg, rm.model.config if rm is not None else None)
    fn = getattr(context.reward_runner, "fn", None)  # a stand-in runner may have none
    during = scores_during_generation(context.cfg, fn, context.generation_device)
    return Scorer(
        context.reward_runner,
        rm,
        context.tokenizer,
        overlong_shaping(context.cfg),
        weights,
        during,
        context.judge,
        context.prm,
        judge_during_generation=judges_during_generation(context.cfg, context.judge),
    )


def judges_during_generation(cfg: PostTrainConfig, judge) -> bool:
    """Whether the judge is asked about each sample as the engine finishes it: for a pointwise judge behind an
    endpoint (it runs elsewhere, so its calls take no CPU from generation) unless
    reward.score_during_generation=never. The verdicts and metrics are the same either way; the step waits less
    for them. A pairwise judge needs a prompt's whole group first."""
    j = cfg.reward.judge
    ahead = bool(j.base_url) and j.mode == "pointwise" and cfg.reward.score_during_generation != "never"
    return judge is not None and ahead


def scores_during_generation(cfg: PostTrainConfig, fn, generation_device: str) -> bool:
    """``reward.score_during_generation``: whether the step's samples are scored while it generates. ``auto``:
    for functions that declare ``samples_at_once`` (thread-safe, and slow enough to be worth hiding: the code
    reward), when generation leaves the CPUs that score free: it runs on a GPU, or the code reward's programs
    run on sandbox hosts (``sandbox.backend=sandbox_fusion``). A cheap rule gains nothing from a thread and
    chunks, and beside a CPU rollout the sandbox's programs slow generation by more than they save
    (docs/sandbox.md)."""
    when = cfg.reward.score_during_generation
    if when != "auto":
        return when == "always"
    cpus_free = generation_device == "cuda" or cfg.sandbox.backend == "sandbox_fusion"
    return cpus_free and declares_samples_at_once(fn)


def scoring_line(cfg: PostTrainConfig, generation_device: str, fn) -> str:
    """One line for `posttrain explain`: when the reward ``fn`` scores a step's samples, and why."""
    when = cfg.reward.score_during_generation
    during = scores_during_generation(cfg, fn, generation_device)
    if when != "auto":
        why = f"reward.score_during_generation={when}"
    elif during:
        why = "auto: generation leaves the scoring CPUs free"
    elif declares_samples_at_once(fn):
        why = f"auto: the rollout runs on {generation_device} and the sandbox would share its CPUs"
    else:
        why = "auto: the function does not declare samples_at_once()"
    return f"scoring: {'during' if during else 'after'} generation ({why}; docs/sandbox.md)"


def context_baselines(context: RolloutContext, scorer: Scorer, prompt_rows: list[int]) -> torch.Tensor | None:
    """ReMax's greedy-response rewards of the step's prompts, when the estimator needs them (else None)."""
    if not estimator_needs(context.cfg.algorithm.adv_estimator).greedy_baseline:
        return None
    max_tokens = context.cfg.data.max_response_length
    return greedy_baselines(
        context.engine, scorer, context.train_prompts, prompt_rows, max_tokens, context.dist, context.share
    )


def assemble_rollout(
    context: RolloutContext,
    drawn: ScoredGroups,
    local: ShareMetrics,
    baselines: torch.Tensor | None,
    engine_metrics: dict[str, float],
) -> tuple[RolloutBatch, dict[str, float]]:
    """The step's batch and rollout metrics from its scored groups (``local``: the metrics gathered so far)."""
    cfg = context.cfg
    flt = group_filter(cfg)
    prompt_rows, result = drawn.rows, drawn.result
    step_prompts = [context.train_prompts.prompt_ids[row] for row in prompt_rows]
    engine_log_probs = has_rollout_log_probs(result) or cfg.algorithm.rollout_correction.bypass_mode
    batch = scored_batch(
        Scored(result, drawn.rewards),
        step_prompts,
        context.tokenizer.pad_token_id,
        baselines,
        engine_log_probs,
        cfg.rollout.multi_turn.turn_rewards,
    )
    if context.teacher_route is not None:  # before any cut to a share: the ids travel with their rows
        records = context.train_prompts.records
        batch.teacher_ids = context.teacher_route.row_ids(
            [records[prompt_rows[g]] for g in batch.group_ids.tolist()]
        )
    # Without the filter `drawn` is this share's samples; with it, the whole step's on every rank: the same
    # step-wide values everywhere (kept as maxima over ranks), cut to the share at the end.
    whole = flt is not None and context.share.distributed
    how = {"mean": MAX, "sum": MAX} if whole else {"mean": MEAN, "sum": SUM}
    weight = len(result)
    unshaped = drawn.scores if cfg.reward.overlong_buffer.enable else None
    # with a model's or a judge's score summed in: reward/rule_accuracy says it
    accuracy = not (cfg.reward.model.enable or cfg.reward.judge.enable or cfg.reward.prm.enable)
    if whole:
        step_metrics = ShareMetrics()
        rollout_metrics(result, drawn.rewards, step_metrics, unshaped, accuracy)
        local.add(dict(step_metrics.values), MAX)
    else:
        rollout_metrics(result, drawn.rewards, local, unshaped, accuracy)
    if context.agent is not None:
        agent_metrics(context, result.episodes or [], local, how, weight)
    if cfg.reward.overlong_buffer.enable and cfg.reward.overlong_buffer.log:
        local.add(overlong_metrics(drawn.penalties), how["mean"], weight=weight)
    if cfg.algorithm.mask_truncated_samples:  # after the scores are placed: the reward still counts
        share = SINGLE_SHARE if whole else context.share
        local.add(mask_truncated(batch, result.finish_reasons, share), how["sum"])
    if whole:
        batch = select_share(batch, context.share)
    elif context.share.distributed:
        batch.step_groups = torch.arange(len(prompt_rows))
    metrics = context.share.reduce(local)
    metrics.update(engine_metrics)  # this rank's engine
    return batch, metrics


def agent_metrics(
    context: RolloutContext, episodes: list, local: ShareMetrics, how: dict, weight: int
) -> None:
    """The trajectories' metrics (turns, tool calls per tool, environment failures); every rank adds the same
    names, also one that drew no sample. A step where every environment failed stops here, clearly."""
    check_not_all_failed(episodes, context.cfg.rollout.multi_turn.max_env_failures)
    gather = context.dist.all_gather_object if context.share.distributed else None
    keys = step_metric_keys(episodes, gather)  # a collective in a distributed run
    tools = logged_tool_names(context.agent.tool_names, episodes, gather)  # one more
    episode_metrics(episodes, local, how, weight, tools, keys, context.agent.summed_metrics)


def validate_context(side: RolloutContext, step: int) -> tuple[dict[str, float], list[dict]]:
    """Generate for the validation prompts and score them (the engine holds its cache memory meanwhile);
    returns the metrics and one row per sample (prompt, response, ground truth, reward)."""
    if side.val_prompts is None:
        return {}, []
    rows: list[dict] = []
    side.engine.wake_up()
    try:
        seed = step_seed(side.cfg.trainer.seed, step, 2)
        metrics = validate(
            side.engine,
            side.tokenizer,
            side.val_prompts,
            side.reward_runner,
            side.cfg,
            seed=seed,
            dist=side.dist,
            samples=rows,
            agent=side.agent,
        )
    finally:
        side.engine.release_memory()
    return metrics, rows
