"""Training curves from ``metrics.jsonl`` as one PNG (matplotlib, Agg, no display needed).

The figure is drawn on a ``Figure`` with an Agg canvas instead of through ``pyplot``, so plotting never
switches the global backend of the caller (a notebook keeps its inline backend) and needs no display.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path

from posttrain.utils.metrics import read_metrics

# One entry per default panel: the first name present in the file is plotted. The trainer's names come
# first; other spellings let the plot work for older runs or other loops.
DEFAULT_CURVES: tuple[tuple[str, ...], ...] = (
    ("reward/mean", "rewards/mean", "reward_mean", "reward"),
    ("val/accuracy", "validation/accuracy", "val/acc", "val_accuracy"),
    ("val/reward_mean", "validation/reward_mean"),
    ("sft/loss",),
    ("val/loss",),
    ("response_length/mean", "response_length", "response_len/mean"),
    ("actor/kl_loss", "actor/reward_kl_penalty", "kl/mean", "actor/kl", "kl"),
    ("actor/entropy", "entropy/mean", "entropy"),
    ("actor/pg_loss", "actor/policy_loss", "policy_loss", "loss/policy"),
    ("critic/loss", "critic/value_loss", "critic/vf_loss", "value_loss"),
    ("actor/grad_norm", "grad_norm"),
)
MAX_FALLBACK_PANELS = 16


def plot_training_curves(
    metrics_jsonl: str | Path, out_png: str | Path, keys: Sequence[str] | None = None
) -> list[str]:
    """Plot one panel per metric key against step and save the grid as ``out_png``.

    Args:
        metrics_jsonl: a file written by :class:`posttrain.utils.metrics.MetricsLogger`.
        out_png: output path; parent directories are created.
        keys: metric keys to plot. None: the usual RL curves (see ``DEFAULT_CURVES``) that the file
            contains, or, if it contains none of them, its first ``MAX_FALLBACK_PANELS`` keys.
            Keys absent from the file are skipped with a warning.

    Returns:
        The keys that were plotted. When there is nothing to plot (empty file, no listed key present)
        the PNG shows a message saying so and the list is empty.

    Sparse series (validation runs every N steps) are drawn with point markers so single points show.
    """
    metrics_jsonl, out_png = Path(metrics_jsonl), Path(out_png)
    if not metrics_jsonl.is_file():
        raise FileNotFoundError(f"metrics_jsonl={metrics_jsonl} does not exist; pass a run's metrics.jsonl")
    records = read_metrics(metrics_jsonl)
    present = _keys_in(records)
    chosen = _choose_keys(present, keys)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    if not chosen:
        if not present:
            reason = f"no metric values in {metrics_jsonl}"
        else:
            reason = f"none of keys={list(keys or [])} in {metrics_jsonl}"
        warnings.warn(f"plot_training_curves: nothing to plot ({reason}); wrote a placeholder", stacklevel=2)
        _save_message(out_png, f"nothing to plot:\n{reason}")
        return []
    _save_grid(out_png, records, chosen, title=metrics_jsonl.parent.name or str(metrics_jsonl))
    return chosen


def _keys_in(records: list[dict]) -> list[str]:
    """Metric keys in first-seen order, without the step column."""
    seen: dict[str, None] = {}
    for record in records:
        seen.update(dict.fromkeys(k for k in record if k != "step"))
    return list(seen)


def _choose_keys(present: list[str], keys: Sequence[str] | None) -> list[str]:
    if keys is not None:
        missing = [k for k in keys if k not in present]
        if missing and present:
            warnings.warn(f"plot_training_curves: skipping keys not in the file: {missing}", stacklevel=3)
        return [k for k in keys if k in present]
    defaults = [
        next(name for name in names if name in present)
        for names in DEFAULT_CURVES
        if set(names) & set(present)
    ]
    return defaults or present[:MAX_FALLBACK_PANELS]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of ``key``; null/NaN points are left out rather than drawn as zero."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(record["step"])
            values.append(float(value))
    return steps, values


def _agg_figure(**kwargs):
    """A Figure on an Agg canvas. matplotlib is imported here, at the end of a run, not when a command starts:
    it costs every process that imports a command (each rank, each test subprocess) half a second."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def _save_grid(out_png: Path, records: list[dict], keys: list[str], title: str) -> None:
    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig = _agg_figure(figsize=(4.6 * ncols, 3.2 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, key in zip(axes, keys):
        steps, values = _series(records, key)
        # Fewer points than half the steps means an every-N-steps metric: show the points themselves.
        sparse = len(steps) < max(2, len(records) // 2)
        ax.plot(steps, values, marker="o" if sparse else None, markersize=4, linewidth=1.2)
        if not steps:  # every value was null/NaN: say so rather than show an empty box
            ax.text(0.5, 0.5, "no finite values", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes[len(keys) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.savefig(out_png, dpi=100)


def _save_message(out_png: Path, message: str) -> None:
    fig = _agg_figure(figsize=(5, 2))
    fig.text(0.5, 0.5, message, ha="center", va="center")
    fig.savefig(out_png, dpi=100)
