"""What the model answers: a few validation samples on the console and every one in a jsonl file.

`train` calls :func:`log_validation_samples` at each validation (``samples.jsonl`` in the run directory, one
line per sample with its step); `eval` prints :func:`samples_table` and writes all its samples the same way.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from posttrain.utils.metrics import SAMPLES_FILENAME, write_samples  # noqa: F401  (one writer: sft's too)

SHOWN = 4  # samples printed per validation: enough to see what the model does, few enough to read


def _text(value, width: int = 60) -> str:
    """A prompt or response on one table line: chat messages by their last content, long text cut."""
    if isinstance(value, list):
        value = value[-1].get("content", "") if value else ""
    text = str(value).replace("\n", "⏎")
    return text if len(text) <= width else text[: width - 1] + "…"


def samples_table(rows: list[dict], title: str, shown: int = SHOWN) -> Table:
    """A rich table of the first ``shown`` samples: prompt, response, expected answer and reward."""
    table = Table(title=title, title_justify="left")
    for name in ("prompt", "response", "answer", "reward"):
        table.add_column(name, justify="right" if name == "reward" else "left", overflow="fold")
    for row in rows[:shown]:
        answer = "" if row.get("ground_truth") is None else _text(row["ground_truth"], 30)
        table.add_row(_text(row["prompt"]), _text(row["response"]), answer, f"{row['reward']:g}")
    return table


def log_validation_samples(run_dir: Path, step: int, rows: list[dict], console: bool = True) -> None:
    """Every sample to ``<run_dir>/samples.jsonl``; the first few on the console."""
    if not rows:
        return
    write_samples(run_dir / SAMPLES_FILENAME, rows, step)
    if console:
        Console(width=120).print(samples_table(rows, f"validation samples at step {step}"))
