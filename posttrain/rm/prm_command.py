"""`posttrain rm` with rm.kind=prm: train a process reward model on stepwise rows and export it.

The run is configured and kept like the pairwise run (posttrain.rm.command): model.path, data.train_files /
data.val_files (stepwise rows here), trainer.run_dir, seed, test_freq, save_freq, resume; rm.batch_size rows
per optimizer step, rm.micro_batch_size_per_gpu rows per forward, rm.epochs / rm.max_steps, rm.max_length,
rm.optim, rm.output_dir. The same training loop (checkpoints, resume, signals, metrics.jsonl, curves.png).
One process on one device: torchrun ranks and LoRA are refused before any model loads.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.models.hf import load_tokenizer
from posttrain.models.model_path import resolve_model_path, write_run_info
from posttrain.parallel.runtime import launched_world_size, ranked_run, select_device
from posttrain.rm.loop import rm_schedule
from posttrain.rm.model import model_config
from posttrain.rm.prm import export_prm, load_prm, prm_step, validate_steps
from posttrain.rm.prm_data import LABELS_KEY, STEPS_KEY, load_stepwise, tokenize_stepwise
from posttrain.sft.builtin import builtin_model_dir
from posttrain.train.checkpoint import find_checkpoint
from posttrain.train.loop import Checkpoints, LoopSettings, TrainLoop, stopped_export_note, stopped_run_note
from posttrain.train.trainable import Trainable
from posttrain.utils.console import TrainingDisplay
from posttrain.utils.metrics import MetricsLogger
from posttrain.utils.plots import plot_training_curves
from posttrain.utils.run_lock import lock_output_dir
from posttrain.utils.seed import seed_everything
from posttrain.utils.signals import stop_note

HEADLINE = {"prm/loss": "loss", "prm/step_accuracy": "step acc", "val/step_accuracy": "val step acc"}


def read_stepwise(cfg: PostTrainConfig):
    """(training rows, held-out rows), every row checked (posttrain.rm.prm_data)."""
    if not cfg.data.train_files:
        raise ConfigError(
            "posttrain rm with rm.kind=prm needs stepwise rows: set data.train_files=[steps.jsonl] (rows with "
            f"{cfg.rm.prompt_key!r}, {STEPS_KEY!r}, {LABELS_KEY!r}); docs/reward-models.md"
        )
    return (
        load_stepwise(cfg.data.train_files, cfg.rm.prompt_key),
        load_stepwise(cfg.data.val_files, cfg.rm.prompt_key),
    )


def check_prm_setup(cfg: PostTrainConfig, world_size: int) -> None:
    """What rm.kind=prm does not do (yet): several ranks, LoRA."""
    if world_size > 1:
        raise ConfigError(
            f"rm.kind=prm trains on one process; it was launched on {world_size} ranks: run it without torchrun"
        )
    if cfg.model.lora_rank > 0:
        raise ConfigError(
            f"model.lora_rank={cfg.model.lora_rank}: rm.kind=prm trains the full model; set model.lora_rank=0"
        )


def _tokenized(cfg: PostTrainConfig, tokenizer, rows, what: str, quiet: bool):
    kept, dropped = tokenize_stepwise(rows, tokenizer, cfg.rm.step_separator, cfg.rm.max_length)
    if dropped and not quiet:
        print(f"{what}: dropped {dropped} of {len(rows)} rows longer than rm.max_length={cfg.rm.max_length}")
    if what == "train" and len(kept) < cfg.rm.batch_size:
        raise ConfigError(
            f"rm.batch_size={cfg.rm.batch_size} exceeds the {len(kept)} usable training rows ({dropped} "
            f"dropped as longer than rm.max_length={cfg.rm.max_length}); lower rm.batch_size or raise rm.max_length"
        )
    return kept


def run_prm_command(cfg: PostTrainConfig, quiet: bool = False) -> Path:
    """Train, validate, export; returns the exported directory."""
    check_prm_setup(cfg, launched_world_size())
    device = select_device(cfg)
    train, val = read_stepwise(cfg)  # bad rows are reported before any model loads
    run_dir = Path(cfg.trainer.run_dir)
    out = Path(cfg.rm.output_dir or run_dir / "reward_model")
    with (
        stop_note(lambda: stopped_run_note(run_dir)),
        ranked_run(device, run_dir, cfg.trainer.dist_timeout_s) as ctx,
    ):
        lock = lock_output_dir(out, "rm.output_dir", run_dir)
        try:
            return _run(cfg, train, val, out, ctx, quiet)
        finally:
            if lock is not None:
                lock.release()


def _run(cfg: PostTrainConfig, train, val, out: Path, ctx, quiet: bool) -> Path:
    seed_everything(cfg.trainer.seed)
    r, t = cfg.rm, cfg.trainer
    run_dir = Path(t.run_dir)
    found = find_checkpoint(run_dir, t.resume)
    path = resolve_model_path(model_config(cfg), quiet=quiet, warm_start=builtin_model_dir)
    tokenizer = load_tokenizer(path)
    train_rows = _tokenized(cfg, tokenizer, train, "train", quiet)
    val_rows = _tokenized(cfg, tokenizer, val, "validation", quiet)
    schedule = rm_schedule(cfg, len(train_rows))
    write_run_info(run_dir, cfg, path)
    model = load_prm(path, tokenizer.pad_token_id, cfg.model.dtype, ctx.device)
    trainable = Trainable.create(model, r.optim, schedule.total_steps)
    checkpoints = Checkpoints(
        run_dir=run_dir,
        modules={"prm": model},
        optimizers={"prm": trainable.optimizer},
        schedulers={"prm": trainable.scheduler},
        keep_last=t.max_ckpt_to_keep,
        dist=ctx,
    )
    start, _ = checkpoints.restore(found, announce=not quiet)
    pad, mb = tokenizer.pad_token_id, r.micro_batch_size_per_gpu
    loop = TrainLoop(
        settings=LoopSettings.of(t, schedule.total_steps),
        step=lambda s: prm_step(trainable, [train_rows[i] for i in schedule.indices(s)], pad, mb),
        roles=("prm",),
        display=TrainingDisplay(
            total_steps=schedule.total_steps,
            keys=HEADLINE,
            start_step=start,
            description="prm",
            disable=quiet or "console" not in t.loggers,
        ),
        logger=MetricsLogger(run_dir, backends=[b for b in t.loggers if b != "console"]),
        validate=(lambda s: validate_steps(model, val_rows, pad, mb)) if val_rows else None,
        checkpoints=checkpoints,
        dist=ctx,
    )
    if start < schedule.total_steps:
        loop.run(start)
    stats = validate_steps(model, val_rows or train_rows, pad, mb)
    with stop_note(stopped_export_note(out)):
        export_prm(model, tokenizer, out, r.step_separator, stats)
    plot_training_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    if not quiet:
        shown = ", ".join(f"{k} {v:.4f}" for k, v in stats.items())
        print(f"Process reward model done: {schedule.total_steps} steps; {shown}; saved {out}")
    return out
