"""plot_training_curves writes a PNG from metrics.jsonl, skipping what is not there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.utils.plots import plot_training_curves

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_metrics(path: Path, n: int = 20) -> Path:
    with open(path, "w") as f:
        for step in range(1, n + 1):
            record = {"step": step, "reward/mean": step / n, "actor/kl": 0.01 * step, "actor/entropy": None}
            if step % 5 == 0:
                record["val/accuracy"] = 0.1 * step / 5
            f.write(json.dumps(record) + "\n")
    return path


def test_default_keys_present_in_file_are_plotted(tmp_path: Path) -> None:
    out = tmp_path / "plots" / "curves.png"
    keys = plot_training_curves(_write_metrics(tmp_path / "metrics.jsonl"), out)
    assert keys == ["reward/mean", "val/accuracy", "actor/kl", "actor/entropy"]
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 5_000


def test_missing_keys_are_skipped(tmp_path: Path) -> None:
    out = tmp_path / "curves.png"
    with pytest.warns(UserWarning, match="critic/value_loss"):
        keys = plot_training_curves(
            _write_metrics(tmp_path / "m.jsonl"), out, keys=["reward/mean", "critic/value_loss"]
        )
    assert keys == ["reward/mean"]
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_unknown_names_fall_back_to_all_keys(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "my_score": s * 2.0}) + "\n" for s in range(5)))
    assert plot_training_curves(path, tmp_path / "c.png") == ["my_score"]


def test_empty_file_writes_placeholder_without_crashing(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    out = tmp_path / "curves.png"
    with pytest.warns(UserWarning, match="nothing to plot"):
        assert plot_training_curves(path, out) == []
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="metrics_jsonl="):
        plot_training_curves(tmp_path / "nope.jsonl", tmp_path / "c.png")
