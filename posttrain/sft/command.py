"""`posttrain sft`: fine-tune model.path (builtin:base for your own task) on prompt/response data and save it.

Run like `train`, on the same training loop (posttrain.train.loop): a progress line on the console,
``metrics.jsonl`` and ``curves.png`` in trainer.run_dir, validation (held-out loss, and accuracy when a reward
is configured) before the first step, every trainer.test_freq steps and at the end (posttrain.sft.validation),
checkpoints every trainer.save_freq steps and at the end, trainer.resume, the skipped-step guard, SIGTERM.

Launched by torchrun (WORLD_SIZE > 1) every rank runs this, as `posttrain rm` does: the same process group
(posttrain.parallel.runtime), the model sharded with FSDP2 over all ranks, each rank training its share of
every step's examples (posttrain.sft.loop); every rank computes the whole held-out loss (its forwards are
collectives of the sharded model) but generates its greedy responses on rank 0 alone (posttrain.sft.validation);
rank 0 alone prints, logs, writes samples and exports.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from posttrain.config.errors import ConfigError
from posttrain.config.plan import build_sft_plan
from posttrain.config.schema import PostTrainConfig
from posttrain.data.datasets import load_records
from posttrain.data.splits import load_splits
from posttrain.data.tasks import get_task
from posttrain.models.export import GatheredExport, export_gathered_policy, export_policy
from posttrain.models.hf import load_causal_lm, load_tokenizer
from posttrain.models.lora import apply_lora, is_lora_model, lora_memory_summary
from posttrain.models.model_path import resolve_model_path, user_data_keys, write_run_info
from posttrain.models.prepare import check_policy_switches, read_model_config
from posttrain.parallel.runtime import DistContext, launched_world_size, ranked_run, select_device
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
from posttrain.utils.run_lock import lock_output_dir
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
    directory, from before anything is written there to the end. Under torchrun every rank runs it; rank 0
    holds the locks and speaks for the job."""
    build_sft_plan(cfg, world_size=launched_world_size())  # a batch the ranks cannot split: before any work
    device = select_device(cfg)
    keep_freed_memory_for_cpu_training(cfg.trainer.tune_malloc, device)
    run_dir = Path(cfg.trainer.run_dir)
    stopped = stop_note(lambda: stopped_run_note(run_dir))  # what a signal leaves behind
    with stopped, ranked_run(device, run_dir, cfg.trainer.dist_timeout_s) as ctx:
        # sft.output_dir outside the run directory is the run's too: two runs exporting there are refused.
        out = lock_output_dir(_output_dir(cfg), "sft.output_dir", run_dir, take=ctx.is_main)
        try:
            saved = _sft(cfg, ctx, quiet or not ctx.is_main)
        finally:
            if out is not None:
                out.release()
        ctx.barrier()  # leave together
        return saved


def _output_dir(cfg: PostTrainConfig) -> Path:
    return Path(cfg.sft.output_dir or Path(cfg.trainer.run_dir) / "sft_model")


def _model_path(cfg: PostTrainConfig, ctx: DistContext, quiet: bool) -> Path:
    """The model directory; under torchrun rank 0 resolves it first (a built-in model is built and cached
    once), then the others read it."""
    if ctx.distributed:
        if ctx.is_main:
            resolve_model_path(cfg, quiet=quiet, warm_start=builtin_model_dir)
        ctx.barrier()
    return resolve_model_path(cfg, quiet=quiet or not ctx.is_main, warm_start=builtin_model_dir)


def _sft(cfg: PostTrainConfig, ctx: DistContext, quiet: bool) -> Path:
    check_policy_switches(cfg, ctx.device, read_model_config(cfg.model.path))  # before any weights load
    seed_everything(cfg.trainer.seed)
    records, val_records, reward = _data(cfg)  # a bad file or row is reported before any model loads
    path = _model_path(cfg, ctx, quiet)
    run_dir = Path(cfg.trainer.run_dir)
    tokenizer = load_tokenizer(path)
    # Before the weights load: the validator builds the run's sandbox when its reward runs code.
    validator = SFTValidator(cfg, tokenizer, val_records, reward) if val_records else None
    model = load_causal_lm(path, cfg.model.dtype, ctx.device)
    if validator is not None:
        validator.on_ranks(ctx, model)
    model = apply_lora(model, cfg)  # LoRA: only adapters train
    if is_lora_model(model) and not quiet:
        print(lora_memory_summary(model, uses_reference=False))
    training = prepare_sft(cfg, model, tokenizer, records, ctx)
    checkpoints = training.checkpoints(run_dir, cfg.trainer.max_ckpt_to_keep)
    start, _ = checkpoints.resume(cfg.trainer.resume, announce=not quiet)
    out = _output_dir(cfg)
    export = _Export(cfg, path, tokenizer, ctx)
    if start >= training.schedule.total_steps:  # nothing to train: nothing in run_dir is rewritten
        return _finished_run(cfg, model, export, out, start, quiet)
    if ctx.is_main:
        info = write_run_info(run_dir, cfg, path)
        if not quiet:
            print(f"Model: {path} (model.path={cfg.model.path}; recorded in {info})")
    result = _train(cfg, training, checkpoints, validator, start, quiet)
    with stop_note(stopped_export_note(out)):
        out, how = export(model, out)
    if ctx.is_main:
        plot_training_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    if not quiet:
        _summary(result.last, training.schedule.total_steps, out, how, run_dir, ctx.world_size)
    return out


class _Export(NamedTuple):
    """export_policy of the trained model; a sharded model's weights are gathered (every rank takes part) and
    rank 0 writes them. The ranks leave together: the export is complete when any rank returns."""

    cfg: PostTrainConfig
    model_path: Path
    tokenizer: object
    ctx: DistContext

    def __call__(self, model, out: Path) -> tuple[Path, str]:
        merge = self.cfg.trainer.export_merged
        if not self.ctx.distributed:
            return export_policy(model, self.tokenizer, out, merge=merge)
        how = GatheredExport(self.model_path, self.cfg.model.dtype, merge, self.ctx.is_main)
        done = export_gathered_policy(model, self.tokenizer, out, how)
        self.ctx.barrier()
        return done


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
        logger=MetricsLogger(Path(t.run_dir), backends=[b for b in t.loggers if b != "console"])
        if training.dist.is_main
        else None,
        validate=(lambda step: validator(training.model, step)) if validator is not None else None,
        checkpoints=checkpoints,
        dist=training.dist,
    )
    return loop.run(start)


def _finished_run(cfg: PostTrainConfig, model, export: _Export, out: Path, step: int, quiet: bool) -> Path:
    """A run directory whose last checkpoint is the run's last step: finish its export when a kill or a full
    disk left it missing or incomplete (from the checkpoint just restored), else refuse."""
    ctx = export.ctx
    if not ctx.broadcast_object(model_dir_complete(out) if ctx.is_main else None):  # rank 0 exports
        if not quiet:
            print(
                f"{cfg.trainer.run_dir} holds a finished SFT run (step {step}) without a complete {out}: exporting it"
            )
        with stop_note(stopped_export_note(out)):
            return export(model, out)[0]
    raise ConfigError(
        f"{cfg.trainer.run_dir} already holds a finished SFT run (checkpoint at step {step}, the last of "
        f"sft.epochs={cfg.sft.epochs} / sft.max_steps={cfg.sft.max_steps}); to train again use a new "
        "trainer.run_dir or trainer.resume=disable, or raise sft.epochs or sft.max_steps to continue it"
    )


def _summary(last: dict[str, float], steps: int, out: Path, how: str, run_dir: Path, ranks: int) -> None:
    val = ", ".join(f"{k} {v:.4f}" for k, v in last.items() if k.startswith("val/"))
    print(
        f"SFT done: {steps} optimizer steps{f' on {ranks} ranks' if ranks > 1 else ''}, final loss {last.get('sft/loss', float('nan')):.4f}"
        + (f", {val}" if val else "")
        + f"; saved {out} ({how})\nMetrics: {run_dir / 'metrics.jsonl'}, curves: {run_dir / 'curves.png'}"
    )
