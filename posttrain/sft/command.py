"""`posttrain sft`: fine-tune model.path (builtin:base for your own task) on prompt/response data and save it.

Run like `train`, on the same training loop (posttrain.train.loop): a progress line on the console,
``metrics.jsonl`` and ``curves.png`` in trainer.run_dir, validation (held-out loss, and accuracy when a reward
is configured) before the first step, every trainer.test_freq steps and at the end (posttrain.sft.validation),
checkpoints every trainer.save_freq steps and at the end, trainer.resume, the skipped-step guard, SIGTERM.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.data.datasets import load_records
from posttrain.data.splits import load_splits
from posttrain.data.tasks import get_task
from posttrain.models.export import export_policy
from posttrain.models.hf import load_causal_lm, load_tokenizer
from posttrain.models.lora import apply_lora, is_lora_model, lora_memory_summary
from posttrain.models.model_path import resolve_model_path, user_data_keys, write_run_info
from posttrain.models.prepare import check_policy_switches, read_model_config
from posttrain.parallel.runtime import select_device
from posttrain.sft.builtin import builtin_model_dir
from posttrain.sft.loop import SFTTraining, prepare_sft, sft_display, sft_records
from posttrain.sft.validation import SFTValidator, sft_val_records
from posttrain.train.loop import (
    Checkpoints,
    LoopResult,
    LoopSettings,
    TrainLoop,
    stopped_export_note,
    stopped_run_note,
)
from posttrain.utils.allocator import keep_freed_memory_for_cpu_training
from posttrain.utils.metrics import MetricsLogger
from posttrain.utils.plots import plot_training_curves
from posttrain.utils.run_lock import lock_output_dir, lock_run_dir
from posttrain.utils.seed import seed_everything
from posttrain.utils.signals import stop_note
from posttrain.utils.storage import model_dir_complete


def _data(cfg: PostTrainConfig):
    """(training records, held-out records, reward spec for accuracy): read before any weights load."""
    if not user_data_keys(cfg):  # the built-in task: its answers are the responses, its reward scores them
        splits = load_splits(cfg)
        reward = cfg.reward.function or get_task(cfg.data.task).default_reward
        return sft_records(cfg, splits.train), sft_val_records(cfg, splits.val), reward
    d = cfg.data
    # Without sft.train_files, data.train_files' answers are the responses (no reward needed to read them).
    fallback = (
        []
        if cfg.sft.train_files
        else [r for f in d.train_files for r in load_records(f, d.prompt_key, d.answer_key)]
    )
    return sft_records(cfg, fallback), sft_val_records(cfg, []), cfg.reward.function


def run_sft_command(cfg: PostTrainConfig, quiet: bool = False) -> Path:
    """`posttrain sft`: fine-tune model.path and save it; returns the saved directory. Holds the run
    directory's lock (the one `posttrain train` takes), and sft.output_dir's where it lies outside the run
    directory, from before anything is written there to the end."""
    device = select_device(cfg)
    keep_freed_memory_for_cpu_training(cfg.trainer.tune_malloc, device)
    with contextlib.ExitStack() as held:
        held.callback(lock_run_dir(cfg.trainer.run_dir).release)
        # sft.output_dir outside the run directory is the run's too: two runs exporting there are refused.
        out = lock_output_dir(_output_dir(cfg), "sft.output_dir", cfg.trainer.run_dir)
        if out is not None:
            held.callback(out.release)
        with stop_note(lambda: stopped_run_note(Path(cfg.trainer.run_dir))):  # what a signal leaves behind
            return _sft(cfg, device, quiet)


def _output_dir(cfg: PostTrainConfig) -> Path:
    return Path(cfg.sft.output_dir or Path(cfg.trainer.run_dir) / "sft_model")


def _sft(cfg: PostTrainConfig, device, quiet: bool) -> Path:
    check_policy_switches(cfg, device, read_model_config(cfg.model.path))  # before any weights load
    seed_everything(cfg.trainer.seed)
    records, val_records, reward = _data(cfg)  # a bad file or row is reported before any model loads
    path = resolve_model_path(cfg, quiet=quiet, warm_start=builtin_model_dir)
    run_dir = Path(cfg.trainer.run_dir)
    tokenizer = load_tokenizer(path)
    # Before the weights load: the validator builds the run's sandbox when its reward runs code.
    validator = SFTValidator(cfg, tokenizer, val_records, reward) if val_records else None
    model = apply_lora(load_causal_lm(path, cfg.model.dtype, device), cfg)  # LoRA: only adapters train
    if is_lora_model(model) and not quiet:
        print(lora_memory_summary(model, uses_reference=False))
    training = prepare_sft(cfg, model, tokenizer, records)
    checkpoints = training.checkpoints(run_dir, cfg.trainer.max_ckpt_to_keep)
    start, _ = checkpoints.resume(cfg.trainer.resume, announce=not quiet)
    out = _output_dir(cfg)
    if start >= training.schedule.total_steps:  # nothing to train: nothing in run_dir is rewritten
        return _finished_run(cfg, model, tokenizer, out, start, quiet)
    info = write_run_info(run_dir, cfg, path)
    if not quiet:
        print(f"Model: {path} (model.path={cfg.model.path}; recorded in {info})")
    result = _train(cfg, training, checkpoints, validator, start, quiet)
    with stop_note(stopped_export_note(out)):
        out, how = export_policy(model, tokenizer, out, merge=cfg.trainer.export_merged)
    plot_training_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    if not quiet:
        _summary(result.last, training.schedule.total_steps, out, how, run_dir)
    return out


def _train(
    cfg: PostTrainConfig,
    training: SFTTraining,
    checkpoints: Checkpoints,
    validator: SFTValidator | None,
    start: int,
    quiet: bool,
) -> LoopResult:
    """Steps start+1..total on the training loop: validation every trainer.test_freq steps (and before a
    fresh run's first), checkpoints every trainer.save_freq (and at the end), metrics.jsonl."""
    t, total = cfg.trainer, training.schedule.total_steps
    loop = TrainLoop(
        settings=LoopSettings.of(t, total),
        step=training.step,
        roles=("sft",),
        display=sft_display(total, start, quiet or "console" not in t.loggers),
        logger=MetricsLogger(Path(t.run_dir), backends=[b for b in t.loggers if b != "console"]),
        validate=(lambda step: validator(training.model, step)) if validator is not None else None,
        checkpoints=checkpoints,
    )
    return loop.run(start)


def _finished_run(cfg: PostTrainConfig, model, tokenizer, out: Path, step: int, quiet: bool) -> Path:
    """A run directory whose last checkpoint is the run's last step: finish its export when a kill or a full
    disk left it missing or incomplete (from the checkpoint just restored), else refuse."""
    if not model_dir_complete(out):
        if not quiet:
            print(
                f"{cfg.trainer.run_dir} holds a finished SFT run (step {step}) without a complete {out}: exporting it"
            )
        with stop_note(stopped_export_note(out)):
            return export_policy(model, tokenizer, out, merge=cfg.trainer.export_merged)[0]
    raise ConfigError(
        f"{cfg.trainer.run_dir} already holds a finished SFT run (checkpoint at step {step}, the last of "
        f"sft.epochs={cfg.sft.epochs} / sft.max_steps={cfg.sft.max_steps}); to train again use a new "
        "trainer.run_dir or trainer.resume=disable, or raise sft.epochs or sft.max_steps to continue it"
    )


def _summary(last: dict[str, float], steps: int, out: Path, how: str, run_dir: Path) -> None:
    val = ", ".join(f"{k} {v:.4f}" for k, v in last.items() if k.startswith("val/"))
    print(
        f"SFT done: {steps} optimizer steps, final loss {last.get('sft/loss', float('nan')):.4f}"
        + (f", {val}" if val else "")
        + f"; saved {out} ({how})\nMetrics: {run_dir / 'metrics.jsonl'}, curves: {run_dir / 'curves.png'}"
    )
