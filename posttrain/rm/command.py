"""`posttrain rm`: train a Bradley-Terry reward model on preference pairs and export it.

Configured like `posttrain sft`: model.path (a causal LM or a one-label classifier; builtin names too),
data.train_files and data.val_files (pairs), trainer.run_dir, trainer.seed, trainer.test_freq,
trainer.save_freq, trainer.resume; the rest in the `rm` section. One run per run directory (the run lock, and
rm.output_dir's outside it), checkpoints and resume as in `posttrain train`, SIGTERM handled as there; a
finished run is refused before any model loads, unless its export is missing, which the rerun then writes. Logged like `sft`: a progress
line, ``metrics.jsonl`` and ``curves.png`` in trainer.run_dir.

Launched by torchrun (WORLD_SIZE > 1) every rank runs this, as `posttrain train` does: the same process group
(posttrain.parallel.runtime), the model sharded with FSDP2 over all ranks (posttrain.parallel.fsdp), each
rank training its share of every step's pairs (posttrain.rm.loop); rank 0 alone prints, logs and exports.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from posttrain.batching.epochs import EpochSchedule
from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.config.schema.roles import ShardingConfig
from posttrain.models.hf import load_tokenizer, resolve_dtype
from posttrain.models.lora import hf_model
from posttrain.models.model_path import resolve_model_path, write_run_info
from posttrain.models.registry import check_packing_supported
from posttrain.parallel.data_parallel import data_parallel
from posttrain.parallel.fsdp import full_state_dict, shard_model
from posttrain.parallel.runtime import (
    DistContext,
    launched_world_size,
    ranked_run,
    select_device,
)
from posttrain.rm.data import load_pairs, tokenize_pairs
from posttrain.rm.loop import rm_checkpoints, rm_schedule, rm_step, validate_pairs
from posttrain.rm.model import add_lora, export_reward_model, load_reward_model, model_config
from posttrain.rm.prm_command import run_prm_command
from posttrain.sft.builtin import builtin_model_dir
from posttrain.train.checkpoint import find_checkpoint
from posttrain.train.loop import (
    Checkpoints,
    LoopSettings,
    TrainLoop,
    checkpoint_step,
    stopped_export_note,
    stopped_run_note,
)
from posttrain.train.trainable import Trainable
from posttrain.utils.allocator import keep_freed_memory_for_cpu_training
from posttrain.utils.console import TrainingDisplay
from posttrain.utils.metrics import MetricsLogger
from posttrain.utils.plots import plot_training_curves
from posttrain.utils.run_lock import lock_output_dir
from posttrain.utils.seed import seed_everything
from posttrain.utils.signals import stop_note
from posttrain.utils.storage import model_dir_complete

HEADLINE = {"rm/loss": "loss", "rm/accuracy": "acc", "val/accuracy": "val acc", "val/margin": "val margin"}


def read_pairs(cfg: PostTrainConfig):
    """(training pairs, held-out pairs), every row checked (posttrain.rm.data)."""
    if not cfg.data.train_files:
        raise ConfigError(
            "posttrain rm needs preference pairs: set data.train_files=[pairs.jsonl] (rows with "
            f"{cfg.rm.prompt_key!r}, {cfg.rm.chosen_key!r}, {cfg.rm.rejected_key!r}); docs/reward-models.md"
        )
    return load_pairs(cfg, cfg.data.train_files), load_pairs(cfg, cfg.data.val_files)


def _tokenized(cfg, tokenizer, pairs, what: str, quiet: bool):
    kept, dropped = tokenize_pairs(pairs, tokenizer, cfg.rm.max_length)
    if dropped and not quiet:
        print(
            f"{what}: dropped {dropped} of {len(pairs)} pairs longer than rm.max_length={cfg.rm.max_length}"
        )
    if what == "train" and not kept:  # no batch size helps: the pairs or the limit must change
        raise ConfigError(
            f"all {len(pairs)} training pairs are longer than rm.max_length={cfg.rm.max_length} tokens "
            "(chosen or rejected with its prompt) and were dropped; raise rm.max_length or shorten the pairs"
        )
    if what == "train" and len(kept) < cfg.rm.batch_size:
        raise ConfigError(
            f"rm.batch_size={cfg.rm.batch_size} exceeds the {len(kept)} usable training pairs "
            f"({dropped} dropped as longer than rm.max_length={cfg.rm.max_length}); lower rm.batch_size"
        )
    return kept, dropped


def token_budget(cfg: PostTrainConfig, pairs) -> int:
    """rm.max_token_len_per_gpu when rm.use_dynamic_bsz is on (0: micro-batches by pair count); a pair that
    does not fit in it alone is refused before training."""
    r = cfg.rm
    if not r.use_dynamic_bsz:
        return 0
    longest = max(len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
    if longest > r.max_token_len_per_gpu:
        raise ConfigError(
            f"rm.max_token_len_per_gpu={r.max_token_len_per_gpu} is smaller than the longest training pair "
            f"({longest} tokens, chosen and rejected together) with rm.use_dynamic_bsz=true; raise it to at "
            f"least {longest} or lower rm.max_length"
        )
    return r.max_token_len_per_gpu


def packed_row_tokens(cfg: PostTrainConfig, model) -> int:
    """model.remove_padding_max_row_tokens with model.use_remove_padding (0: padded rows); the architecture
    must be one verified for packing."""
    if not cfg.model.use_remove_padding:
        return 0
    check_packing_supported(hf_model(model).config)
    return cfg.model.remove_padding_max_row_tokens


def check_ranks(cfg: PostTrainConfig, world_size: int) -> None:
    """rm.batch_size must split evenly over the data-parallel ranks (each trains an equal share of a step's
    pairs), as data.train_batch_size and sft.batch_size must for `posttrain train` and `posttrain sft`."""
    b = cfg.rm.batch_size
    if b % world_size:
        lower, upper = (b // world_size) * world_size, (b // world_size + 1) * world_size
        nearest = " or ".join(str(v) for v in (lower, upper) if v > 0)
        raise ConfigError(
            f"rm.batch_size={b} must split evenly over the {world_size} data-parallel ranks (the processes "
            f"torchrun starts; --world-size for explain), each training rm.batch_size / ranks pairs of every "
            f"step. Nearest "
            f"valid: rm.batch_size={nearest}, or launch a number of ranks that divides {b}"
        )


def _build_model(cfg: PostTrainConfig, path: Path, tokenizer, ctx: DistContext):
    """The reward model on this rank's device (LoRA added); sharded with FSDP2 over all ranks under torchrun."""
    model = add_lora(load_reward_model(path, tokenizer.pad_token_id, cfg.model.dtype, ctx.device), cfg)
    if ctx.distributed:
        # The scalar head is called on its own (posttrain.rm.model.sequence_scores); inside a PEFT wrapper it
        # is not a child of the root, so it is named here to get a unit of its own.
        head = (hf_model(model).score,)
        shard_model(model, ctx, ShardingConfig(), resolve_dtype(cfg.model.dtype), head)
    return model


def _export(cfg: PostTrainConfig, model, path: Path, tokenizer, ctx: DistContext, out: Path, stats) -> Path:
    """export_reward_model of the trained weights; a sharded model's full weights are gathered (every rank
    takes part) and rank 0 exports them from a plain copy built the same way."""
    if not ctx.distributed:
        return export_reward_model(model, tokenizer, out, stats)
    state = {name: t.detach().cpu() for name, t in full_state_dict(model).items()}  # a collective
    if ctx.is_main:
        plain = add_lora(load_reward_model(path, tokenizer.pad_token_id, cfg.model.dtype, "cpu"), cfg)
        plain.load_state_dict(state)
        export_reward_model(plain, tokenizer, out, stats)
    ctx.barrier()  # the export is complete when any rank returns
    return out


def run_rm_command(cfg: PostTrainConfig, quiet: bool = False) -> Path:
    """`posttrain rm`: train, validate, export; returns the exported directory. Under torchrun every rank
    runs it; rank 0 holds the run lock and speaks for the job. rm.kind=prm trains a process reward model
    instead (posttrain.rm.prm_command)."""
    if cfg.rm.kind == "prm":
        return run_prm_command(cfg, quiet)
    check_ranks(cfg, launched_world_size())  # before the data is read and any model loads
    device = select_device(cfg)
    keep_freed_memory_for_cpu_training(cfg.trainer.tune_malloc, device)
    train, val = read_pairs(cfg)  # bad rows are reported before any model loads
    run_dir = Path(cfg.trainer.run_dir)
    stopped = stop_note(lambda: stopped_run_note(run_dir))  # what a signal leaves behind
    with stopped, ranked_run(device, run_dir, cfg.trainer.dist_timeout_s) as ctx:
        # rm.output_dir outside the run directory is the run's too: a second run exporting there is refused.
        lock = lock_output_dir(_output_dir(cfg), "rm.output_dir", run_dir, take=ctx.is_main)
        try:
            out = _run(cfg, train, val, run_dir, ctx, quiet or not ctx.is_main)
        finally:
            if lock is not None:
                lock.release()
        ctx.barrier()  # leave together
        return out


def _output_dir(cfg: PostTrainConfig) -> Path:
    return Path(cfg.rm.output_dir or Path(cfg.trainer.run_dir) / "reward_model")


def _model_path(cfg: PostTrainConfig, ctx: DistContext, quiet: bool) -> Path:
    """The model directory; under torchrun rank 0 resolves it first (a built-in model is built and cached, a
    Hub id downloaded, once), then the others read it."""
    if ctx.distributed:
        if ctx.is_main:
            resolve_model_path(model_config(cfg), quiet=quiet, warm_start=builtin_model_dir)
        ctx.barrier()
    return resolve_model_path(model_config(cfg), quiet=quiet or not ctx.is_main, warm_start=builtin_model_dir)


def _finished(cfg: PostTrainConfig, done: int, total: int, ctx: DistContext, quiet: bool) -> bool:
    """Whether the checkpoint trainer.resume names (of step ``done``) ends the run: then its export is
    finished when a kill or a full disk left it missing or incomplete, else the rerun is refused. Decided
    before any model loads; a refused rerun writes nothing."""
    if done < total:
        return False
    out = _output_dir(cfg)
    whole = ctx.broadcast_object(model_dir_complete(out) if ctx.is_main else None)  # rank 0 exports
    if whole:
        raise ConfigError(
            f"{cfg.trainer.run_dir} already holds a finished reward-model run (checkpoint at step {done}, the "
            f"last of rm.epochs={cfg.rm.epochs} / rm.max_steps={cfg.rm.max_steps}) and its export {out}; to "
            "train again use a new trainer.run_dir or trainer.resume=disable, or raise rm.epochs or "
            "rm.max_steps to continue it"
        )
    if not quiet:
        print(
            f"{cfg.trainer.run_dir} holds a finished reward-model run (step {done}) without a complete "
            f"{out}: exporting it"
        )
    return True


def _run(cfg, train, val, run_dir: Path, ctx: DistContext, quiet: bool) -> Path:
    seed_everything(cfg.trainer.seed)
    r, t = cfg.rm, cfg.trainer
    found = find_checkpoint(run_dir, t.resume)  # verified; its step is read before any model loads
    path = _model_path(cfg, ctx, quiet)
    tokenizer = load_tokenizer(path)
    train_pairs, _ = _tokenized(cfg, tokenizer, train, "train", quiet)
    val_pairs, _ = _tokenized(cfg, tokenizer, val, "validation", quiet)
    budget = token_budget(cfg, train_pairs)  # before the weights load
    schedule = rm_schedule(cfg, len(train_pairs))
    finished = _finished(cfg, checkpoint_step(found), schedule.total_steps, ctx, quiet)
    if ctx.is_main and not finished:  # only a run that trains records what it trains
        info = write_run_info(run_dir, cfg, path)
        if not quiet:
            print(f"Model: {path} (model.path={cfg.model.path}; recorded in {info})")
    model = _build_model(cfg, path, tokenizer, ctx)
    dp = data_parallel(ctx)
    trainable = Trainable.create(model, r.optim, schedule.total_steps)
    checkpoints = rm_checkpoints(run_dir, trainable, t.max_ckpt_to_keep, ctx)
    start, _ = checkpoints.restore(found, announce=not quiet)
    if not finished:
        pairs = _Pairs(train_pairs, val_pairs, budget, schedule)
        _train(cfg, trainable, pairs, tokenizer, checkpoints, start, ctx, quiet)
    stats = validate_pairs(
        model, val_pairs or train_pairs, tokenizer.pad_token_id, r.micro_batch_size_per_gpu, dp
    )
    return _finish(cfg, model, path, tokenizer, ctx, stats, schedule.total_steps, quiet)


class _Pairs(NamedTuple):
    """What the steps train on: the tokenized pairs, the token budget of a micro-batch, the epoch schedule."""

    train: list
    val: list
    budget: int
    schedule: EpochSchedule


def _train(
    cfg: PostTrainConfig,
    trainable: Trainable,
    pairs: _Pairs,
    tokenizer,
    checkpoints: Checkpoints,
    start: int,
    ctx: DistContext,
    quiet: bool,
) -> None:
    """Steps start+1..total on the training loop (posttrain.train.loop), validated on the held-out pairs."""
    r, t, model, dp = cfg.rm, cfg.trainer, trainable.module, data_parallel(ctx)
    train_pairs, val_pairs, budget, schedule = pairs
    run_dir = Path(t.run_dir)
    pad, mb, packed = tokenizer.pad_token_id, r.micro_batch_size_per_gpu, packed_row_tokens(cfg, model)

    def step(s: int) -> dict[str, float]:
        pairs = [train_pairs[i] for i in schedule.indices(s)]
        return rm_step(
            trainable,
            pairs,
            pad_token_id=pad,
            pairs_per_micro=mb,
            center_coef=r.center_rewards_coefficient,
            max_tokens=budget,
            packed_row_tokens=packed,
            dp=dp,
        )

    loop = TrainLoop(
        settings=LoopSettings.of(t, schedule.total_steps),
        step=step,
        roles=("rm",),
        display=TrainingDisplay(
            total_steps=schedule.total_steps,
            keys=HEADLINE,
            start_step=start,
            description="rm",
            disable=quiet or "console" not in t.loggers,
        ),
        logger=MetricsLogger(run_dir, backends=[b for b in t.loggers if b != "console"])
        if ctx.is_main
        else None,
        validate=(lambda s: validate_pairs(model, val_pairs, pad, mb, dp)) if val_pairs else None,
        checkpoints=checkpoints,
        dist=ctx,
    )
    loop.run(start)


def _finish(cfg, model, path: Path, tokenizer, ctx: DistContext, stats, steps: int, quiet: bool) -> Path:
    """Export the model with its score statistics (``stats``: the held-out pairs', else the training
    pairs'), plot the curves, say what was done."""
    run_dir = Path(cfg.trainer.run_dir)
    stored = {"reward_mean": stats["val/reward_mean"], "reward_std": stats["val/reward_std"]}
    with stop_note(stopped_export_note(_output_dir(cfg))):
        out = _export(cfg, model, path, tokenizer, ctx, _output_dir(cfg), stored)
    if ctx.is_main:
        plot_training_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    if not quiet:
        shown = ", ".join(f"{k} {v:.4f}" for k, v in stats.items())
        ranks = f" on {ctx.world_size} ranks" if ctx.distributed else ""
        print(f"Reward model done: {steps} steps{ranks}; {shown}; saved {out}")
    return out
