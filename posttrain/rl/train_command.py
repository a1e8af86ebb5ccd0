"""`posttrain train`: the RL run, top to bottom.

setup → (resume) → the training loop (posttrain.train.loop: validate, [step → validate every test_freq → log
→ checkpoint every save_freq]) with `rl.step.train_step` as its step → HF export and curves. Each phase lives in
its own module; this file only orders them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from posttrain.config.errors import ConfigError
from posttrain.config.plan import build_plan
from posttrain.config.schema import PostTrainConfig
from posttrain.models.export import GatheredExport, export_gathered_policy, export_policy
from posttrain.models.model_path import resolve_model_path
from posttrain.parallel.runtime import (
    DistContext,
    launched_world_size,
    ranked_run,
    select_device,
)
from posttrain.rl.build import Components, build_components, write_run_metadata
from posttrain.rl.collect.samples import log_validation_samples
from posttrain.rl.collect.source import RolloutSource
from posttrain.rl.overlap.hosts import ThreadHost, start_ray_host
from posttrain.rl.overlap.queue import RolloutQueue
from posttrain.rl.overlap.worker import RolloutWorker
from posttrain.rl.step import inline_rollouts, train_step
from posttrain.rollout.base import RolloutEngine
from posttrain.sft.builtin import builtin_model_dir
from posttrain.train.loop import (
    Checkpoints,
    LoopResult,
    LoopSettings,
    TrainLoop,
    stopped_export_note,
    stopped_run_note,
)
from posttrain.utils.allocator import keep_freed_memory_for_cpu_training
from posttrain.utils.console import TrainingDisplay
from posttrain.utils.metrics import METRICS_FILENAME, MetricsLogger, PhaseTimer, reward_failure_summary
from posttrain.utils.plots import plot_training_curves
from posttrain.utils.seed import seed_everything
from posttrain.utils.signals import stop_note
from posttrain.utils.storage import model_dir_complete

log = logging.getLogger("posttrain")

HEADLINE = (
    "reward/mean",
    "val/accuracy",
    "response_length/mean",
    "actor/entropy",
    "actor/kl_loss",
    "actor/pg_clipfrac",
    "critic/loss",
    "timing/step",
)


def checkpoints(run: Components, run_dir: Path, source: RolloutSource | None = None) -> Checkpoints:
    """What a checkpoint of the run holds: the actor (a LoRA actor's adapters only: frozen weights are not
    stored, train/sharded_state.py), the critic, their optimizers and schedules, the prompt sampler's state and
    the KL coefficient."""
    roles = {"actor": run.actor} | ({"critic": run.critic} if run.critic is not None else {})

    def loop_state(step: int) -> dict:
        # Rollouts generated ahead have drawn prompts past `step`: save where the synchronous loop would be.
        state = {"sampler": (source or inline_rollouts(run)).sampler_state_after(step)}
        if run.kl_ctrl is not None:
            state["kl_coef"] = float(run.kl_ctrl.value)
        return state

    return Checkpoints(
        run_dir=run_dir,
        modules={k: r.module for k, r in roles.items()},
        optimizers={k: r.optimizer for k, r in roles.items()},
        schedulers={k: r.scheduler for k, r in roles.items()},
        keep_last=run.cfg.trainer.max_ckpt_to_keep,
        dist=run.dist,
        loop_state=loop_state,
    )


def maybe_resume(run: Components, run_dir: Path) -> int:
    """Restore the latest (or the named) checkpoint; returns the last completed step (0: fresh)."""
    start, state = checkpoints(run, run_dir).resume(run.cfg.trainer.resume, announce=run.dist.is_main)
    if start == 0:
        return 0
    run.sampler.load_state_dict(state["sampler"])
    if run.kl_ctrl is not None and "kl_coef" in state:
        run.kl_ctrl.value = state["kl_coef"]
    if run.rollout_weights is not None:  # a rollout worker of its own gets them when it starts
        run.rollout_weights.push(run.actor.module)  # the engine's own copy must see the restored weights
    return start


def run_validation(
    run: Components, step: int, quiet: bool = True, source: RolloutSource | None = None
) -> dict:
    """Generate for the validation prompts and score them (the engine holds its cache memory only meanwhile),
    here or, with rollouts ahead, on the rollout worker after what is queued; rank 0 logs what the model
    answered (samples.jsonl, a few on the console)."""
    if run.val_prompts is None:
        return {}
    metrics, rows = (source or inline_rollouts(run)).validate(step)
    if run.dist.is_main:
        log_validation_samples(Path(run.cfg.trainer.run_dir), step, rows, console=not quiet)
    return metrics


def run_training(cfg: PostTrainConfig, quiet: bool = False) -> dict[str, float]:
    """Train as configured; returns the final step's metrics (with the last validation).

    Launched by torchrun (WORLD_SIZE > 1), every rank runs this; rank 0 alone prints, logs and exports.
    """
    build_plan(cfg, launched_world_size())  # a config error surfaces before any process group or model
    device = select_device(cfg)
    keep_freed_memory_for_cpu_training(cfg.trainer.tune_malloc, device)
    seed_everything(cfg.trainer.seed)
    # One run per run_dir: rank 0 takes its lock before anything in it is written (ranked_run).
    stopped = stop_note(lambda: stopped_run_note(Path(cfg.trainer.run_dir)))  # what a signal leaves behind
    with stopped, ranked_run(device, cfg.trainer.run_dir, cfg.trainer.dist_timeout_s) as ctx:
        if ctx.distributed and cfg.model.path == "builtin:tiny":
            # One rank builds (and caches) the built-in warm start; the others then read the cache.
            if ctx.is_main:
                resolve_model_path(cfg, quiet=quiet, warm_start=builtin_model_dir)
            ctx.barrier()
        result, engine = _train(cfg, ctx, quiet=quiet or not ctx.is_main)
        ctx.barrier()  # leave together
        if engine is not None:  # after the last collective: an in-process vLLM engine tears the group down
            engine.close()
        return result


def _train(
    cfg: PostTrainConfig, ctx: DistContext, quiet: bool
) -> tuple[dict[str, float], RolloutEngine | None]:
    """Build, resume, train, export; returns the last metrics and the rollout engine (closed by the caller)."""
    run = build_components(cfg, quiet=quiet, dist=ctx)
    run_dir = Path(cfg.trainer.run_dir)
    t = cfg.trainer
    began = time.monotonic()
    start = maybe_resume(run, run_dir)
    if start >= t.total_steps:  # nothing to train: nothing in run_dir is rewritten
        run.close()
        return _finished_run(run, run_dir, start, quiet), run.engine
    if ctx.is_main:
        write_run_metadata(run_dir, cfg, run.plan, run.model_path)
        if not quiet:
            print(
                f"Model: {run.model_path} (model.path={cfg.model.path}; recorded in {run_dir / 'run_info.yaml'})"
            )
    try:
        result = _run_steps(run, run_dir, start, quiet)
    finally:
        run.close()
    first_val, last = result.first_validation, result.last
    _finish(run, run_dir, quiet)
    if not quiet and ctx.is_main and (failed := reward_failure_summary(run_dir / METRICS_FILENAME)):
        print(failed)
    if not quiet and "val/accuracy" in last:
        before = f"{first_val['val/accuracy']:.1%} → " if first_val else ""
        print(
            f"Validation accuracy {before}{last['val/accuracy']:.1%} after {t.total_steps} steps "
            f"({time.monotonic() - began:.0f} s of training)"
        )
    return last, run.engine  # None when a rollout worker of its own held the engine


def _finished_run(run: Components, run_dir: Path, step: int, quiet: bool) -> dict[str, float]:
    """A run directory whose last checkpoint is trainer.total_steps: finish its export when a kill or a full
    disk left final_model/ missing or incomplete (from the checkpoint just restored), else refuse."""
    t = run.cfg.trainer
    if t.export_hf and not model_dir_complete(run_dir / "final_model"):
        if run.dist.is_main and not quiet:
            print(
                f"{run_dir} holds a finished run (step {step}) without a complete final_model/: exporting it"
            )
        _finish(run, run_dir, quiet)
        return {}
    raise ConfigError(
        f"{run_dir} already holds a finished run (checkpoint at step {step}, trainer.total_steps="
        f"{t.total_steps}); to train again use a new trainer.run_dir, trainer.resume=disable, or raise "
        "trainer.total_steps to continue it"
    )


def _run_steps(run: Components, run_dir: Path, start: int, quiet: bool) -> LoopResult:
    """Steps start+1..total_steps on the one training loop (posttrain.train.loop), the samples from the
    rollout source (inline or ahead); rank 0 logs."""
    t, timer = run.cfg.trainer, PhaseTimer()
    source = rollout_source(run, start)
    display = TrainingDisplay(
        total_steps=t.total_steps,
        keys=HEADLINE,
        start_step=start,
        description="train",
        disable=quiet or "console" not in t.loggers,
    )
    backends = [b for b in t.loggers if b != "console"]
    loop = TrainLoop(
        settings=LoopSettings.of(t, t.total_steps),
        step=lambda step: train_step(run, step, timer, source),
        roles=("actor", "critic"),
        display=display,
        logger=MetricsLogger(run_dir, backends=backends, config=None) if run.dist.is_main else None,
        # With rollouts ahead: after this step's weights reach the worker, before later rollouts.
        validate=lambda step: run_validation(run, step, quiet, source),
        checkpoints=checkpoints(run, run_dir, source),
        dist=run.dist,
    )
    try:
        return loop.run(start)
    finally:
        source.close()


def rollout_source(run: Components, start: int) -> RolloutSource:
    """Where the steps' samples come from: collected inline when rollout and training alternate; else the
    rollouts-ahead queue of `async_training` on its worker: a thread sharing this process's engine, or a
    Ray-placed process that builds its own and starts from this process's weights and prompt order."""
    a = run.cfg.async_training
    if not a.enable:
        return inline_rollouts(run)
    if a.rollout_worker == "ray":
        # With several trainer ranks, rank 0 alone talks to the worker (it generates whole steps).
        host = (
            start_ray_host(run.cfg, run.model_path, start, run.sampler.state_dict())
            if run.dist.is_main
            else None
        )
        remote = True
    else:
        host, remote = ThreadHost(RolloutWorker(run, start)), False
    total = run.cfg.trainer.total_steps
    queue = RolloutQueue(
        host, a.max_staleness, start, total, partial=a.partial_rollout, dist=run.dist, share=run.share
    )
    if remote:  # it loaded the weights from disk: the actor's (resumed, LoRA merged) come first
        queue.push(start, run.actor.module)
    return queue


def _finish(run: Components, run_dir: Path, quiet: bool) -> None:
    if run.cfg.trainer.export_hf:
        with stop_note(stopped_export_note(run_dir / "final_model")):
            _export(run, run_dir, quiet)
    if not run.dist.is_main:
        return
    png = run_dir / "curves.png"
    if plot_training_curves(run_dir / "metrics.jsonl", png) and not quiet:
        print(f"Training curves: {png}")


def _export(run: Components, run_dir: Path, quiet: bool) -> None:
    """final_model/: every rank takes part in gathering sharded weights; rank 0 writes them."""
    if run.dist.distributed:
        out, how = export_gathered_policy(
            run.actor.module,
            run.tokenizer,
            run_dir / "final_model",
            GatheredExport(
                run.model_path, run.cfg.model.dtype, run.cfg.trainer.export_merged, run.dist.is_main
            ),
        )
    else:
        out, how = export_policy(
            run.actor.module, run.tokenizer, run_dir / "final_model", run.cfg.trainer.export_merged
        )
    if run.dist.is_main and not quiet:
        print(f"Final policy exported to {out} ({how})")
    run.dist.barrier()
