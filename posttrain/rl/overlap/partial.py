"""Partial rollouts (`async_training.partial_rollout`): a step's rollout starts ahead of training, like any
rollout ahead, but generates at most ``partial_rollout_tokens`` tokens per response there; the responses left
unfinished are continued just before the step trains, with the newest weights.

Two calls of the rollout worker make a step's samples, in the queue order of ``posttrain.rl.overlap.queue``:

- *start s* (queued k steps ahead, after the load of version s-1-k): draws the step's prompts and generates
  at most P tokens per response (the step's plain seed; ReMax's greedy baselines are generated here whole);
- *finish s* (queued right before the trainer waits for step s, after the load of version s-1): resubmits
  every response that stopped on the length cap before data.max_response_length, prompt + partial response
  as the prompt, for the remaining tokens (a seed of its own: ``CONTINUE_SALT``), then scores the step.

The schedule does not depend on timing, so a seed reproduces a run. Each token keeps the log-prob of the
policy that sampled it (``batch.token_versions`` says which), so the rollout correction weights every token
against its own behaviour policy. With P >= data.max_response_length nothing is continued and the samples are
those of ``partial_rollout=false``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from posttrain.config.plan import partial_rollout_tokens
from posttrain.config.schema import PostTrainConfig
from posttrain.data.batch import RolloutBatch
from posttrain.rl.collect.context import RolloutContext
from posttrain.rl.collect.generation import generate_share, score_share, step_seed, training_params
from posttrain.rl.collect.group_filter import ScoredGroups, generation_salt
from posttrain.rl.collect.phase import assemble_rollout, context_baselines, context_scorer
from posttrain.rollout.base import RolloutEngine, RolloutResult, SamplingParams
from posttrain.utils.metrics import PhaseTimer

CONTINUE_SALT = 3  # step_seed salt of a step's continuations (0-2 are taken, generation batches from 1000)


@dataclass
class StartedRollout:
    """A step's rollout as its start left it, kept on the worker until its finish."""

    rows: list[int]  # the step's prompt records
    result: RolloutResult  # the partial responses (``prompt_index`` indexes ``rows``)
    version: int  # the weights that started every response
    baselines: torch.Tensor | None
    engine_metrics: dict[str, float]
    metrics: dict[str, float]  # the start's timings
    sampler_before: dict


def start_params(cfg: PostTrainConfig, step: int) -> SamplingParams:
    """How a step's start samples: the step's plain seed and settings, at most P tokens."""
    full = training_params(cfg, step_seed(cfg.trainer.seed, step, generation_salt(0)))
    return replace(full, max_tokens=min(partial_rollout_tokens(cfg), full.max_tokens))


def continue_params(cfg: PostTrainConfig, step: int) -> SamplingParams:
    """How a step's continuations sample (one each; ``max_tokens`` is set per call): a seed of their own."""
    return replace(training_params(cfg, step_seed(cfg.trainer.seed, step, CONTINUE_SALT)), n=1)


def start_rollout(context: RolloutContext, step: int, version: int, timer: PhaseTimer) -> StartedRollout:
    """Draw step ``step``'s prompts and generate the first P tokens of each response (one process: async
    training is refused on several ranks)."""
    before = context.sampler.state_dict()
    with timer.phase("rollout"):
        context.engine.wake_up()
        rows = context.sampler.next_batch()
        _, result = generate_share(
            context.engine, context.train_prompts, rows, start_params(context.cfg, step), context.dist
        )
        baselines = context_baselines(context, context_scorer(context), rows)
        engine_metrics = context.engine.generation_metrics()
        context.engine.release_memory()
    return StartedRollout(rows, result, version, baselines, engine_metrics, timer.pop(), before)


def continue_unfinished(
    engine: RolloutEngine,
    prompt_ids: list[list[int]],
    partial: RolloutResult,
    max_tokens: int,
    params: SamplingParams,
) -> tuple[RolloutResult, list[int]]:
    """``partial`` with every response that stopped on the length cap short of ``max_tokens`` continued (its
    prompt + response resubmitted as the prompt, for the tokens left), and the indices of those samples.
    Tokens and log-probs are appended; the finish reason is the continuation's. Continuations of one length
    go in one call, their sample ids in sample order across calls."""
    out = RolloutResult(
        prompt_index=list(partial.prompt_index),
        response_ids=[list(r) for r in partial.response_ids],
        response_logprobs=[list(lp) for lp in partial.response_logprobs],
        finish_reasons=list(partial.finish_reasons),
    )
    todo = [
        i
        for i, (ids, why) in enumerate(zip(partial.response_ids, partial.finish_reasons))
        if why == "length" and len(ids) < max_tokens
    ]
    ordered = sorted(todo, key=lambda i: (len(partial.response_ids[i]), i))
    offset = 0
    for length in sorted({len(partial.response_ids[i]) for i in todo}):
        samples = [i for i in ordered if len(partial.response_ids[i]) == length]
        prompts = [prompt_ids[partial.prompt_index[i]] + partial.response_ids[i] for i in samples]
        extra = {"prompt_offset": offset} if offset else {}
        more = engine.generate(prompts, replace(params, max_tokens=max_tokens - length), **extra)
        for k, i in enumerate(samples):
            out.response_ids[i] += more.response_ids[k]
            out.response_logprobs[i] += more.response_logprobs[k]
            out.finish_reasons[i] = more.finish_reasons[k]
        offset += len(samples)
    return out, todo


def finish_rollout(
    context: RolloutContext, started: StartedRollout, step: int, version: int, timer: PhaseTimer
) -> tuple[RolloutBatch, dict[str, float]]:
    """Continue step ``step``'s unfinished responses with the weights of ``version``, score the step and lay
    it out as a batch; records which version sampled each token and the partial-rollout metrics."""
    cfg = context.cfg
    prompt_ids = [context.train_prompts.prompt_ids[row] for row in started.rows]
    with timer.phase("rollout_finish"):
        context.engine.wake_up()
        result, continued = continue_unfinished(
            context.engine,
            prompt_ids,
            started.result,
            cfg.data.max_response_length,
            continue_params(cfg, step),
        )
        context.engine.release_memory()
    scorer = context_scorer(context)
    scored, local = score_share(scorer, context.train_prompts, started.rows, 0, result, context.share)
    drawn = ScoredGroups(started.rows, scored.result, scored.scores, scorer.penalties(scored.result))
    batch, metrics = assemble_rollout(context, drawn, local, started.baselines, started.engine_metrics)
    before, lengths = [len(r) for r in started.result.response_ids], result.response_lengths
    versions = (started.version, version)
    batch.token_versions = token_versions(batch.response_width, before, lengths, *versions)
    metrics.update(partial_metrics(before, lengths, continued, *versions, newest=step - 1))
    return batch, metrics


def token_versions(
    width: int, before: list[int], lengths: list[int], started: int, finished: int
) -> torch.Tensor:
    """[B, ``width``] the version that sampled each response token: ``started`` for the first ``before[i]``
    tokens of row i, ``finished`` for the rest of its ``lengths[i]``, -1 past the response."""
    out = torch.full((len(lengths), width), -1, dtype=torch.long)
    for i, (cut, n) in enumerate(zip(before, lengths)):
        out[i, :cut] = started
        out[i, cut:n] = finished
    return out


def partial_metrics(
    before: list[int], lengths: list[int], continued: list[int], started: int, finished: int, newest: int
) -> dict[str, float]:
    """``async/partial_samples`` (the fraction of samples continued), ``async/tokens_continued`` (of response
    tokens, the fraction generated by the finish) and ``async/tokens_from_newest`` (the fraction sampled by
    the newest weights, version ``newest``: all of them where the start had those weights too)."""
    total = max(1, sum(lengths))
    late = sum(n - b for n, b in zip(lengths, before))
    newest_tokens = (total - late if started == newest else 0) + (late if finished == newest else 0)
    return {
        "async/partial_samples": len(continued) / max(1, len(lengths)),
        "async/tokens_continued": late / total,
        "async/tokens_from_newest": newest_tokens / total,
    }
