"""`posttrain train`: the RL loop, top to bottom.

setup → (resume) → validate → [step → log → validate every test_freq → checkpoint every save_freq]
→ final checkpoint, HF export and curves. Each phase lives in its own module; this file only orders them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file

from posttrain.config.errors import ConfigError
from posttrain.config.plan import build_plan
from posttrain.config.schema import PostTrainConfig
from posttrain.models.hf import save_hf
from posttrain.models.lora import adapter_state, export_policy, is_lora_model, policy_weights
from posttrain.parallel.runtime import (
    DistContext,
    init_distributed,
    launched_world_size,
    select_device,
    shutdown_distributed,
)
from posttrain.rl.build import Components, build_components, write_run_metadata
from posttrain.rl.evaluate import validate
from posttrain.rl.samples import log_validation_samples
from posttrain.rl.step import step_seed, train_step
from posttrain.sft.builtin import resolve_model_path
from posttrain.train.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from posttrain.utils.console import TrainingDisplay
from posttrain.utils.metrics import MetricsLogger, PhaseTimer
from posttrain.utils.plots import plot_training_curves
from posttrain.utils.seed import seed_everything

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


def _modules(c: Components) -> tuple[dict, dict, dict]:
    # A LoRA actor's checkpoint holds its adapters only: frozen weights are not stored (engine/sharded_state.py).
    modules, optims, scheds = (
        {"actor": c.actor.module},
        {"actor": c.actor.optimizer},
        {"actor": c.actor.scheduler},
    )
    if c.critic is not None:
        modules["critic"], optims["critic"], scheds["critic"] = (
            c.critic.module,
            c.critic.optimizer,
            c.critic.scheduler,
        )
    return modules, optims, scheds


def save(c: Components, run_dir: Path, step: int) -> Path:
    modules, optims, scheds = _modules(c)
    state = {"step": step, "sampler": c.sampler.state_dict()}
    if c.kl_ctrl is not None:
        state["kl_coef"] = float(c.kl_ctrl.value)
    return save_checkpoint(
        run_dir,
        step,
        modules=modules,
        optimizers=optims,
        schedulers=scheds,
        trainer_state=state,
        keep_last=c.cfg.trainer.max_ckpt_to_keep,
    )


def maybe_resume(c: Components, run_dir: Path) -> int:
    """Restore the latest (or the named) checkpoint; returns the last completed step (0: fresh)."""
    ckpt = find_checkpoint(run_dir, c.cfg.trainer.resume)
    if ckpt is None:
        return 0
    modules, optims, scheds = _modules(c)
    state = load_checkpoint(ckpt, modules=modules, optimizers=optims, schedulers=scheds)
    c.sampler.load_state_dict(state["sampler"])
    if c.kl_ctrl is not None and "kl_coef" in state:
        c.kl_ctrl.value = state["kl_coef"]
    if c.engine.model is not c.actor.module:  # the engine's own copy must see the restored weights
        c.engine.sync_weights(policy_weights(c.actor.module))
    if c.dist.is_main:
        print(f"Resumed from {ckpt} (step {state['step']})")
    return int(state["step"])


def run_validation(c: Components, step: int, quiet: bool = True) -> dict[str, float]:
    if c.val_prompts is None:
        return {}
    rows: list[dict] = []
    metrics = validate(
        c.engine,
        c.tokenizer,
        c.val_prompts,
        c.reward_runner,
        c.cfg,
        seed=step_seed(c.cfg.trainer.seed, step, 2),
        dist=c.dist,
        samples=rows,
    )
    if c.dist.is_main:  # rank 0's share: what the model answers, in samples.jsonl and a few on the console
        log_validation_samples(Path(c.cfg.trainer.run_dir), step, rows, console=not quiet)
    return metrics


def run_training(cfg: PostTrainConfig, quiet: bool = False) -> dict[str, float]:
    """Train as configured; returns the final step's metrics (with the last validation).

    Launched by torchrun (WORLD_SIZE > 1), every rank runs this; rank 0 alone prints, logs and exports.
    """
    build_plan(cfg, launched_world_size())  # a config error surfaces before any process group or model
    seed_everything(cfg.trainer.seed)
    ctx = init_distributed(select_device(cfg), cfg.trainer.dist_timeout_s)
    try:
        if ctx.distributed and cfg.model.path == "builtin:tiny":
            # One rank builds (and caches) the built-in warm start; the others then read the cache.
            if ctx.is_main:
                resolve_model_path(cfg, quiet=quiet)
            ctx.barrier()
        result = _train(cfg, ctx, quiet=quiet or not ctx.is_main)
        # Leave together: gloo aborts a process whose group is torn down while a peer still talks to it.
        ctx.barrier()
        return result
    except Exception as exc:
        if ctx.distributed and _is_collective_failure(exc):
            log.error(
                "rank %d of %d: a collective failed or waited longer than trainer.dist_timeout_s=%g s; another "
                "rank has probably died or hung (see its own error above). Stopping this rank.",
                ctx.rank,
                ctx.world_size,
                cfg.trainer.dist_timeout_s,
            )
        raise
    finally:
        shutdown_distributed()


def _is_collective_failure(exc: BaseException) -> bool:
    """Errors torch.distributed raises when a peer is gone (connection closed) or silent (timeout)."""
    text = str(exc).lower()
    return isinstance(exc, dist.DistBackendError) or any(
        word in text for word in ("timed out", "timeout", "connection closed", "connection reset", "gloo")
    )


def _train(cfg: PostTrainConfig, ctx: DistContext, quiet: bool) -> dict[str, float]:
    c = build_components(cfg, quiet=quiet, dist=ctx)
    run_dir = Path(cfg.trainer.run_dir)
    if ctx.is_main:
        write_run_metadata(run_dir, cfg, c.plan, c.model_path)
        if not quiet:
            print(
                f"Model: {c.model_path} (model.path={cfg.model.path}; recorded in {run_dir / 'run_info.yaml'})"
            )
    t = cfg.trainer
    backends = [b for b in t.loggers if b != "console"]
    logger = MetricsLogger(run_dir, backends=backends, config=None) if ctx.is_main else None
    timer = PhaseTimer()
    began = time.monotonic()
    start = maybe_resume(c, run_dir)
    if start >= t.total_steps:
        c.close()
        raise ConfigError(
            f"{run_dir} already holds a finished run (checkpoint at step {start}, trainer.total_steps="
            f"{t.total_steps}); to train again use a new trainer.run_dir, trainer.resume=disable, or raise "
            "trainer.total_steps to continue it"
        )
    display = TrainingDisplay(
        total_steps=t.total_steps,
        keys=HEADLINE,
        start_step=start,
        description="train",
        disable=quiet or "console" not in t.loggers,
    )
    display.start()
    last: dict[str, float] = {}
    first_val: dict[str, float] = {}
    try:
        if start == 0 and t.test_freq > 0:
            last = first_val = run_validation(c, 0, quiet)
            if logger is not None:
                logger.log(last, step=0)
            display.message(f"initial validation: {_fmt(last)}")
        for step in range(start + 1, t.total_steps + 1):
            metrics = train_step(c, step, timer)
            if t.test_freq > 0 and (step % t.test_freq == 0 or step == t.total_steps):
                metrics.update(run_validation(c, step, quiet))
            if logger is not None:
                logger.log(metrics, step=step)
            display.update(step, metrics)
            last = metrics
            if (t.save_freq and step % t.save_freq == 0) or step == t.total_steps:
                save(c, run_dir, step)
    finally:
        display.stop()
        if logger is not None:
            logger.close()
        c.close()
    _finish(c, run_dir, quiet)
    if not quiet and "val/accuracy" in last:
        before = f"{first_val['val/accuracy']:.1%} → " if first_val else ""
        print(
            f"Validation accuracy {before}{last['val/accuracy']:.1%} after {t.total_steps} steps "
            f"({time.monotonic() - began:.0f} s of training)"
        )
    return last


def _fmt(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.3f}" for k, v in metrics.items())


def _export_gathered(c: Components, path: Path) -> tuple[Path, str]:
    """The final export of a sharded actor: the full (merged) weights are gathered into the rollout engine's
    plain copy, or, for a LoRA adapter export, the adapter tensors alone; rank 0 writes them."""
    policy = c.actor.module
    if is_lora_model(policy) and not c.cfg.trainer.export_merged:
        adapters = {name: t.detach().cpu().contiguous() for name, t in adapter_state(policy)}
        if c.dist.is_main:
            path.mkdir(parents=True, exist_ok=True)
            policy.peft_config["default"].save_pretrained(path)
            save_file(adapters, str(path / "adapter_model.safetensors"))
            c.tokenizer.save_pretrained(path)
        return path, "a PEFT LoRA adapter; loads with peft.PeftModel.from_pretrained(base_model, path)"
    c.engine.sync_weights(policy_weights(policy))
    if c.dist.is_main:
        save_hf(c.engine.model, c.tokenizer, path)
    how = "LoRA merged into the base weights; " if is_lora_model(policy) else ""
    return path, how + "loads with AutoModelForCausalLM"


def _finish(c: Components, run_dir: Path, quiet: bool) -> None:

    if c.cfg.trainer.export_hf:
        if c.dist.distributed:
            # Every rank takes part in gathering the sharded weights; rank 0 writes them.
            out, how = _export_gathered(c, run_dir / "final_model")
        else:
            out, how = export_policy(
                c.actor.module, c.tokenizer, run_dir / "final_model", c.cfg.trainer.export_merged
            )
        if c.dist.is_main and not quiet:
            print(f"Final policy exported to {out} ({how})")
        c.dist.barrier()
    if not c.dist.is_main:
        return
    png = run_dir / "curves.png"
    if plot_training_curves(run_dir / "metrics.jsonl", png) and not quiet:
        print(f"Training curves: {png}")
