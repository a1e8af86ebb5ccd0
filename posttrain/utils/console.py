"""Console output for training: a progress bar plus one compact metrics line per step.

On a terminal a rich progress bar (step i/total, elapsed, ETA) stays at the bottom and metric lines
scroll above it. When output is piped (CI logs, ``| tee``) there is no live bar: rich cannot redraw a
file, so each line carries the progress itself and is printed unwrapped, one line per step::

    12:00:41 step 12/100 | reward/mean 0.532 | kl 0.00123 | step 3.41s | elapsed 0:00:41 | eta 0:05:00

The ETA follows the recent pace, not the average since the start: a machine that gets busy (or quiet) in
the middle of a run, or a slow first step, would otherwise skew it for the rest of the run.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text


def format_value(value: Any) -> str:
    """Short, fixed-ish width text for a metric value (4 significant digits, no float noise)."""
    if value is None:
        return "-"
    if isinstance(value, (bool, int, str)):
        return str(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if not math.isfinite(number):
        return str(number)
    if abs(number) >= 1000:
        return f"{number:.0f}"
    if abs(number) >= 100:
        return f"{number:.1f}"
    return f"{number:.4g}"


def format_duration(seconds: float) -> str:
    """``H:MM:SS``, the format rich's progress columns use."""
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# Weight of the newest step in the recent seconds-per-step (an exponentially weighted mean): a step's
# weight halves about every two steps, so a change of pace shows in the ETA within a few steps.
RECENT_WEIGHT = 0.3


class TrainingDisplay:
    """Progress bar and per-step metric lines for a training loop.

    >>> with TrainingDisplay(total_steps=100, keys={"reward/mean": "reward", "kl/mean": "kl"}) as display:
    ...     for step in range(1, 101):
    ...         display.update(step, metrics)  # doctest: +SKIP

    Args:
        total_steps: steps of the whole run (the bar's total).
        keys: metrics to show, in order: a list of metric keys, or a mapping key -> short label.
            None shows every metric passed to :meth:`update`. Keys missing at a step are skipped.
        start_step: step a resumed run starts from, so the bar and ETA begin there.
        console: where to print; default: a new rich Console on stdout.
        disable: print nothing at all (quiet mode, or ranks other than 0).
        every: print a metrics line every this many steps (and at the last step); the bar moves every step.
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(
        self,
        total_steps: int,
        *,
        keys: Sequence[str] | Mapping[str, str] | None = None,
        start_step: int = 0,
        console: Console | None = None,
        disable: bool = False,
        every: int = 1,
        description: str = "train",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps={total_steps} must be >= 1")
        if every < 1:
            raise ValueError(f"every={every} must be >= 1 (1 prints every step)")
        self.total_steps = total_steps
        self.labels = dict(keys) if isinstance(keys, Mapping) else {k: k for k in keys} if keys else None
        self.start_step = start_step
        self.console = console if console is not None else Console()
        self.disable = disable
        self.every = every
        self.description = description
        # A live bar needs cursor control; on a pipe or dumb terminal the lines carry the progress.
        self.live = self.console.is_terminal and not self.console.is_dumb_terminal
        self._progress: Progress | None = None
        self._task: Any = None
        self._clock = clock
        self._started_at = clock()
        self._last = (start_step, self._started_at)  # (step, time) of the last update
        self._step_seconds: float | None = None  # recent seconds per step

    def start(self) -> None:
        self._started_at = self._clock()
        self._last = (self.start_step, self._started_at)
        if self.disable or not self.live or self._progress is not None:
            return
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta {task.fields[eta]}"),
            console=self.console,
        )
        self._task = self._progress.add_task(
            self.description, total=self.total_steps, completed=self.start_step, eta="-:--:--"
        )
        self._progress.start()

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> TrainingDisplay:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Record that ``step`` (1-based, of ``total_steps``) finished and print its metrics line."""
        self._observe(step)
        if self.disable:
            return
        if self._progress is not None:
            eta = self.eta_seconds(step)
            shown = "-:--:--" if eta is None else format_duration(eta)
            self._progress.update(self._task, completed=step, eta=shown)
        if step % self.every == 0 or step >= self.total_steps:
            self.message(self.format_line(step, metrics or {}))

    def _observe(self, step: int) -> None:
        """Fold the time since the last update into the recent seconds per step."""
        now = self._clock()
        last_step, last_time = self._last
        if step <= last_step:
            return
        seconds = (now - last_time) / (step - last_step)
        recent = self._step_seconds
        self._step_seconds = (
            seconds if recent is None else RECENT_WEIGHT * seconds + (1 - RECENT_WEIGHT) * recent
        )
        self._last = (step, now)

    def eta_seconds(self, step: int) -> float | None:
        """Seconds left after ``step`` at the recent pace; None before the first step or after the last."""
        if self._step_seconds is None or step >= self.total_steps:
            return None
        return self._step_seconds * (self.total_steps - step)

    def message(self, text: str) -> None:
        """Print a line (e.g. "saved checkpoint ...") with a timestamp, above the bar if there is one."""
        if self.disable:
            return
        line = Text.assemble((time.strftime("%H:%M:%S "), "dim"), text)
        # soft_wrap: one physical line per message in logs, however many metrics it lists.
        self.console.print(line, soft_wrap=not self.live)

    def format_line(self, step: int, metrics: Mapping[str, Any]) -> str:
        """``step i/total | label value | ... | elapsed h:mm:ss | eta h:mm:ss``."""
        labels = self.labels if self.labels is not None else {k: k for k in metrics}
        parts = [f"step {step}/{self.total_steps}"]
        parts += [f"{label} {format_value(metrics[key])}" for key, label in labels.items() if key in metrics]
        for key in ("reward/num_failures", "reward/num_timeouts"):  # shown whenever not zero
            if metrics.get(key) and key not in labels:
                parts.append(f"{key} {format_value(metrics[key])}")
        parts.append(f"elapsed {format_duration(self._clock() - self._started_at)}")
        eta = self.eta_seconds(step)
        if eta is not None:
            parts.append(f"eta {format_duration(eta)}")
        return " | ".join(parts)


def print_table(title: str, rows: Sequence[Mapping[str, Any]], *, console: Console | None = None) -> None:
    """Print ``rows`` as a table; columns are the union of the rows' keys in first-seen order."""
    console = console if console is not None else Console()
    if not rows:
        console.print(f"{title}: (no rows)", highlight=False)
        return
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    table = Table(title=title)
    for column in columns:
        table.add_column(str(column), justify="left" if isinstance(rows[0].get(column), str) else "right")
    for row in rows:
        table.add_row(*(format_value(row.get(column)) for column in columns))
    if not console.is_terminal:
        # A file has no real width: render at the table's natural width instead of squeezing cells
        # (Console.print caps its width argument at the console's width, hence the sibling console).
        natural = Measurement.get(console, console.options.update_width(10_000), table).maximum
        if natural > console.width:
            console = Console(file=console.file, width=natural, force_terminal=False, color_system=None)
    console.print(table)


_WARNED: set[str] = (
    set()
)  # keys already warned about in this process (a run checks the policy twice: RL, SFT)


def warn_once(key: str, message: str, category: type[Warning] = UserWarning, stacklevel: int = 2) -> None:
    """``warnings.warn`` once per process for ``key`` (a config key whose setting deserves a word)."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, category, stacklevel=stacklevel + 1)
