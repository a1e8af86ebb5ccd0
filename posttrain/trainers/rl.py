"""`posttrain train`: the RL loop, top to bottom.

setup → (resume) → validate → [step → log → validate every test_freq → checkpoint every save_freq]
→ final checkpoint, HF export and curves. Each phase lives in its own module; this file only orders them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from posttrain.config.schema import PostTrainConfig
from posttrain.engine.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from posttrain.models.lora import checkpoint_module, export_policy
from posttrain.trainers.common import seed_everything
from posttrain.trainers.evaluate import validate
from posttrain.trainers.setup import Components, build_components, write_run_metadata
from posttrain.trainers.step import step_seed, train_step
from posttrain.utils.console import TrainingDisplay
from posttrain.utils.metrics import MetricsLogger, PhaseTimer

log = logging.getLogger("posttrain")

HEADLINE = (
    "reward/mean", "val/accuracy", "response_length/mean", "actor/entropy", "actor/kl_loss",
    "actor/pg_clipfrac", "critic/loss", "timing/step",
)  # fmt: skip


def _modules(c: Components) -> tuple[dict, dict, dict]:
    # A LoRA actor's checkpoint holds its adapters only (the frozen base is reloaded from model.path).
    actor = checkpoint_module(c.actor.module)
    modules, optims, scheds = {"actor": actor}, {"actor": c.actor.optimizer}, {"actor": c.actor.scheduler}
    if c.critic is not None:
        modules["critic"], optims["critic"], scheds["critic"] = c.critic.module, c.critic.optimizer, c.critic.scheduler
    return modules, optims, scheds


def save(c: Components, run_dir: Path, step: int) -> Path:
    modules, optims, scheds = _modules(c)
    state = {"step": step, "sampler": c.sampler.state_dict()}
    if c.kl_ctrl is not None:
        state["kl_coef"] = float(c.kl_ctrl.value)
    return save_checkpoint(
        run_dir, step, modules=modules, optimizers=optims, schedulers=scheds, trainer_state=state,
        keep_last=c.cfg.trainer.max_ckpt_to_keep,
    )  # fmt: skip


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
    print(f"Resumed from {ckpt} (step {state['step']})")
    return int(state["step"])


def run_validation(c: Components, step: int) -> dict[str, float]:
    if c.val_prompts is None:
        return {}
    return validate(c.engine, c.tokenizer, c.val_prompts, c.reward_runner, c.cfg, seed=step_seed(c.cfg.trainer.seed, step, 2))


def run_training(cfg: PostTrainConfig, quiet: bool = False) -> dict[str, float]:
    """Train as configured; returns the final step's metrics (with the last validation)."""
    seed_everything(cfg.trainer.seed)
    c = build_components(cfg, quiet=quiet)
    run_dir = Path(cfg.trainer.run_dir)
    write_run_metadata(run_dir, cfg, c.plan)
    t = cfg.trainer
    backends = [b for b in t.loggers if b != "console"]
    logger = MetricsLogger(run_dir, backends=backends, config=None)
    timer = PhaseTimer()
    began = time.monotonic()
    start = maybe_resume(c, run_dir)
    if start >= t.total_steps:
        c.close()
        raise ValueError(
            f"{run_dir} already holds a finished run (checkpoint at step {start}, trainer.total_steps="
            f"{t.total_steps}); to train again use a new trainer.run_dir, trainer.resume=disable, or raise "
            "trainer.total_steps to continue it"
        )
    display = TrainingDisplay(
        total_steps=t.total_steps, keys=HEADLINE, start_step=start, description="train",
        disable=quiet or "console" not in t.loggers,
    )  # fmt: skip
    display.start()
    last: dict[str, float] = {}
    first_val: dict[str, float] = {}
    try:
        if start == 0 and t.test_freq > 0:
            last = first_val = run_validation(c, 0)
            logger.log(last, step=0)
            display.message(f"initial validation: {_fmt(last)}")
        for step in range(start + 1, t.total_steps + 1):
            metrics = train_step(c, step, timer)
            if t.test_freq > 0 and (step % t.test_freq == 0 or step == t.total_steps):
                metrics.update(run_validation(c, step))
            logger.log(metrics, step=step)
            display.update(step, metrics)
            last = metrics
            if (t.save_freq and step % t.save_freq == 0) or step == t.total_steps:
                save(c, run_dir, step)
    finally:
        display.stop()
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


def _finish(c: Components, run_dir: Path, quiet: bool) -> None:
    from posttrain.utils.plots import plot_training_curves

    if c.cfg.trainer.export_hf:
        out, how = export_policy(c.actor.module, c.tokenizer, run_dir / "final_model", c.cfg.trainer.export_merged)
        if not quiet:
            print(f"Final policy exported to {out} ({how})")
    png = run_dir / "curves.png"
    if plot_training_curves(run_dir / "metrics.jsonl", png) and not quiet:
        print(f"Training curves: {png}")
