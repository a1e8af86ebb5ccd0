"""What `posttrain eval` shows: which model, how many problems, a table of a few samples, the metrics, and
where every sample was written (``<trainer.run_dir>/eval_samples.jsonl``, replaced on each eval)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from posttrain.config.schema import PostTrainConfig
from posttrain.rl.collect.samples import samples_table, write_samples

EVAL_SAMPLES = "eval_samples.jsonl"


def data_description(cfg: PostTrainConfig) -> str:
    if cfg.data.val_files:
        return "data.val_files=" + ",".join(cfg.data.val_files)
    return f"the built-in {cfg.data.task!r} task's held-out problems"


def report_eval(
    cfg: PostTrainConfig, model: str, rows: list[dict], metrics: dict[str, float], quiet: bool = False
) -> Path:
    """Write every sample to the run directory and print the summary; returns the samples file."""
    path = Path(cfg.trainer.run_dir) / EVAL_SAMPLES
    path.unlink(missing_ok=True)
    write_samples(path, rows)
    if quiet:
        return path
    console = Console(width=120, soft_wrap=True)  # soft wrap: paths in the lines stay whole, copyable
    console.print(f"Evaluated {model} on {len(rows)} problems ({data_description(cfg)})")
    console.print(samples_table(rows, f"first {min(len(rows), 5)} of {len(rows)} samples", shown=5))
    for key, value in metrics.items():
        console.print(f"{key}: {value:.4f}")
    console.print(f"All {len(rows)} prompts, responses and rewards: {path}")
    return path
