"""MetricsLogger, reduce_metrics, read_metrics and PhaseTimer."""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain.utils.metrics import (
    MetricsLogger,
    PhaseTimer,
    keep_records_through,
    read_metrics,
    reduce_metrics,
)


def test_jsonl_one_record_per_step_with_floats_and_nulls(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as logger:
        logger.log({"reward/mean": torch.tensor(0.5), "len": np.float32(12.0), "ok": True, "n": 3}, step=1)
        logger.log({"loss": float("nan"), "kl": float("inf"), "acc": np.array([0.25])}, step=2)
        # flushed per write: readable before close
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 2
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "reward/mean": 0.5, "len": 12.0, "ok": 1.0, "n": 3.0},
        {"step": 2, "loss": None, "kl": None, "acc": 0.25},
    ]


def test_appends_on_resume_and_read_metrics_merges_per_step(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as logger:
        logger.log({"a": 1.0}, step=1)
        logger.log({"a": 2.0}, step=2)
        logger.log({"val/acc": 0.5}, step=2)
    with MetricsLogger(tmp_path, backends=["jsonl"]) as logger:  # resumed from step 1
        logger.log({"a": 20.0}, step=2)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "a": 1.')  # a line cut short by a crash
    with pytest.warns(UserWarning, match="skipped 1 line"):
        records = read_metrics(tmp_path / "metrics.jsonl")
    assert records == [{"step": 1, "a": 1.0}, {"step": 2, "a": 20.0, "val/acc": 0.5}]


def test_rewind_drops_the_records_of_later_steps_before_they_are_written_again(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as logger:
        for step in (0, 1, 2, 3):
            logger.log({"a": float(step)}, step=step)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "a": 1.')  # a line cut short by a kill
    with MetricsLogger(tmp_path) as logger:  # resumed from the checkpoint of step 2: redoes step 3
        logger.rewind(2)
        logger.log({"a": 30.0}, step=3)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 0, "a": 0.0},
        {"step": 1, "a": 1.0},
        {"step": 2, "a": 2.0},
        {"step": 3, "a": 30.0},
    ]
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"step": s, "response": "x"}) + "\n" for s in (0, 1, 1, 2, 3)))
    keep_records_through(samples, 1)
    assert [json.loads(line)["step"] for line in samples.read_text().splitlines()] == [0, 1, 1]
    keep_records_through(samples, -1)  # a fresh run: none kept
    assert samples.read_text() == ""


def test_bad_inputs_raise_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"backend 'mlflow'.*\['jsonl', 'tensorboard', 'wandb'\]"):
        MetricsLogger(tmp_path, backends=["jsonl", "mlflow"])
    with MetricsLogger(tmp_path) as logger:
        with pytest.raises(ValueError, match="'x' is a tensor with 3 elements"):
            logger.log({"x": torch.ones(3)}, step=0)
        with pytest.raises(ValueError, match="'name' has value 'abc'"):
            logger.log({"name": "abc"}, step=0)
        with pytest.raises(ValueError, match="step=-1"):
            logger.log({"x": 1.0}, step=-1)


def test_missing_optional_backend_names_the_extra(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install posttrain\[wandb\]"):
        MetricsLogger(tmp_path, backends=["wandb"])
    with pytest.raises(ImportError, match=r"pip install posttrain\[tensorboard\]"):
        MetricsLogger(tmp_path, backends=["tensorboard"])


def test_wandb_backend_uses_run_api(tmp_path: Path, monkeypatch) -> None:
    calls: list[tuple] = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with MetricsLogger(
        tmp_path, backends=["wandb"], config={"lr": 1e-6}, project="p", run_name="r"
    ) as logger:
        logger.log({"reward": torch.tensor(1.5)}, step=7)
    assert calls[0] == ("init", {"project": "p", "name": "r", "config": {"lr": 1e-6}, "dir": str(tmp_path)})
    assert calls[1:] == [("log", {"reward": 1.5}, 7), ("finish",)]


def test_tensorboard_backend_writes_scalars(tmp_path: Path, monkeypatch) -> None:
    calls: list[tuple] = []

    class FakeWriter:
        def __init__(self, log_dir):
            calls.append(("init", log_dir))

        def add_text(self, tag, text):
            calls.append(("text", tag))

        def add_scalar(self, key, value, global_step):
            calls.append(("scalar", key, value, global_step))

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(
        sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter)
    )
    with MetricsLogger(tmp_path, backends=["jsonl", "tensorboard"], config={"lr": 1e-6}) as logger:
        logger.log({"kl": np.float32(0.5)}, step=3)
    assert calls == [
        ("init", str(tmp_path / "tensorboard")),
        ("text", "config"),
        ("scalar", "kl", 0.5, 3),
        ("close",),
    ]


def test_reduce_metrics_means_per_key() -> None:
    reduced = reduce_metrics([{"a": 1.0, "b": torch.tensor(2.0)}, {"a": 3.0}, {"b": np.float64(4.0)}])
    assert reduced == {"a": 2.0, "b": 3.0}
    assert reduce_metrics([]) == {}


def test_phase_timer_accumulates_and_pops() -> None:
    syncs = []
    timer = PhaseTimer(synchronize=lambda: syncs.append(1))
    with timer.phase("rollout"):
        time.sleep(0.02)
    with timer.phase("rollout"):
        time.sleep(0.02)
    with pytest.raises(RuntimeError), timer.phase("update"):
        raise RuntimeError("the phase still gets timed")
    metrics = timer.pop()
    assert set(metrics) == {"timing/rollout", "timing/update"}
    assert 0.04 <= metrics["timing/rollout"] < 1.0
    assert len(syncs) == 6
    assert timer.pop() == {}
