"""`posttrain rm`: train a Bradley-Terry reward model on preference pairs and export it.

Configured like `posttrain sft`: model.path (a causal LM or a one-label classifier; builtin names too),
data.train_files and data.val_files (pairs), trainer.run_dir, trainer.seed, trainer.test_freq,
trainer.save_freq, trainer.resume; the rest in the `rm` section. One run per run directory (the run lock),
checkpoints and resume as in `posttrain train`, SIGTERM handled as there. Logged like `sft`: a progress
line, ``metrics.jsonl`` and ``curves.png`` in trainer.run_dir.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.config.errors import ConfigError
from posttrain.config.load import apply_values
from posttrain.config.schema import PostTrainConfig
from posttrain.models.hf import load_tokenizer
from posttrain.models.lora import hf_model
from posttrain.models.registry import check_packing_supported
from posttrain.parallel.runtime import select_device
from posttrain.rm.data import load_pairs, tokenize_pairs
from posttrain.rm.loop import LoopSettings, RMSchedule, resume, run_steps, validate_pairs
from posttrain.rm.model import add_lora, export_reward_model, load_reward_model
from posttrain.sft.builtin import resolve_model_path, write_run_info
from posttrain.train.trainable import Trainable
from posttrain.utils.console import TrainingDisplay
from posttrain.utils.metrics import MetricsLogger
from posttrain.utils.plots import plot_training_curves
from posttrain.utils.run_lock import lock_run_dir
from posttrain.utils.seed import seed_everything

HEADLINE = {"rm/loss": "loss", "rm/accuracy": "acc", "val/accuracy": "val acc", "val/margin": "val margin"}


def _read_pairs(cfg: PostTrainConfig):
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


def model_config(cfg: PostTrainConfig) -> PostTrainConfig:
    """The config the model directory is resolved with. data.train_files here are pairs, not the user's task:
    builtin:tiny (the arithmetic demo's warm-started model, built from the data.task keys) is allowed, as the
    start of the reward-model demonstration (docs/reward-models.md)."""
    if cfg.model.path != "builtin:tiny":
        return cfg
    return apply_values(cfg, {"data.train_files": [], "data.val_files": [], "sft.train_files": []})


def _build_model(cfg: PostTrainConfig, path: Path, tokenizer, device):
    model = load_reward_model(path, tokenizer.pad_token_id, cfg.model.dtype, device)
    return add_lora(model, cfg)


def run_rm_command(cfg: PostTrainConfig, quiet: bool = False) -> Path:
    """`posttrain rm`: train, validate, export; returns the exported directory."""
    device = select_device(cfg)
    train, val = _read_pairs(cfg)  # bad rows are reported before any model loads
    run_dir = Path(cfg.trainer.run_dir)
    lock = lock_run_dir(run_dir)
    try:
        return _run(cfg, train, val, run_dir, device, quiet)
    finally:
        lock.release()


def _run(cfg, train, val, run_dir: Path, device, quiet: bool) -> Path:
    seed_everything(cfg.trainer.seed)
    path = resolve_model_path(model_config(cfg), quiet=quiet)
    info = write_run_info(run_dir, cfg, path)
    if not quiet:
        print(f"Model: {path} (model.path={cfg.model.path}; recorded in {info})")
    tokenizer = load_tokenizer(path)
    train_pairs, _ = _tokenized(cfg, tokenizer, train, "train", quiet)
    val_pairs, _ = _tokenized(cfg, tokenizer, val, "validation", quiet)
    budget = token_budget(cfg, train_pairs)  # before the weights load
    model = _build_model(cfg, path, tokenizer, device)
    r, t = cfg.rm, cfg.trainer
    schedule = RMSchedule(len(train_pairs), r.batch_size, r.epochs, r.max_steps, t.seed)
    trainable = Trainable.create(model, r.optim, schedule.total_steps)
    start = resume(run_dir, t.resume, trainable, quiet)
    if start >= schedule.total_steps:
        raise ConfigError(
            f"{run_dir} already holds a finished reward-model run (checkpoint at step {start} of "
            f"{schedule.total_steps}); use a new trainer.run_dir or trainer.resume=disable"
        )
    pad, mb = tokenizer.pad_token_id, r.micro_batch_size_per_gpu
    logger = MetricsLogger(run_dir, backends=[b for b in t.loggers if b != "console"])
    display = TrainingDisplay(
        total_steps=schedule.total_steps, keys=HEADLINE, start_step=start, description="rm", disable=quiet
    )
    last: dict[str, float] = {}

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if val_pairs and t.test_freq and (step % t.test_freq == 0 or step == schedule.total_steps):
            metrics.update(validate_pairs(model, val_pairs, pad, mb))
        logger.log(metrics, step=step)
        display.update(step, metrics)
        last.update(metrics)

    settings = LoopSettings(
        run_dir, pad, mb, r.center_rewards_coefficient, t.save_freq, t.max_ckpt_to_keep,
        t.max_skipped_steps, t.save_on_terminate, budget, packed_row_tokens(cfg, model),
    )  # fmt: skip
    display.start()
    try:
        if start == 0 and val_pairs and t.test_freq:
            first = validate_pairs(model, val_pairs, pad, mb)
            logger.log(first, step=0)
            display.message("initial validation: " + ", ".join(f"{k}={v:.4f}" for k, v in first.items()))
        run_steps(settings, trainable, train_pairs, schedule, start, on_step)
    finally:
        display.stop()
        logger.close()
    stats = validate_pairs(model, val_pairs or train_pairs, pad, mb)
    out = export_reward_model(
        model,
        tokenizer,
        Path(r.output_dir or run_dir / "reward_model"),
        {"reward_mean": stats["val/reward_mean"], "reward_std": stats["val/reward_std"]},
    )
    plot_training_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
    if not quiet:
        shown = ", ".join(f"{k} {v:.4f}" for k, v in stats.items())
        print(f"Reward model done: {schedule.total_steps} steps; {shown}; saved {out}")
    return out
