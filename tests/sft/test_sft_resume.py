"""`posttrain sft` on the training loop: checkpoints, a killed run resumed to the same weights and metrics,
a finished run refused or its missing export finished, a LoRA run resumed."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.cli import main
from posttrain.train.checkpoint import list_checkpoints
from posttrain.utils.metrics import read_metrics

pytestmark = pytest.mark.long  # each resume test kills and restarts a training subprocess

ROOT = Path(__file__).resolve().parents[2]


def _args(model_dir, run: Path, *extra) -> list[str]:
    """16 examples in batches of 4 over 2 epochs (8 steps, the second epoch reshuffled), validated every 2
    steps, a checkpoint every 2."""
    rows = [{"prompt": f"What is {i} + 1?", "response": str(i + 1)} for i in range(20)]
    data = run.parent / "sft.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows[:16]))
    val = run.parent / "val.jsonl"
    val.write_text("\n".join(json.dumps(r) for r in rows[16:]))
    return [
        f"model.path={model_dir}",
        f"trainer.run_dir={run}",
        f"sft.train_files=[{data}]",
        f"sft.val_files=[{val}]",
        "sft.batch_size=4",
        "sft.micro_batch_size_per_gpu=2",
        "sft.epochs=2",
        "sft.optim.lr=3e-3",
        "sft.optim.lr_schedule=cosine",
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        "trainer.loggers=jsonl",
        *extra,
    ]


def _cli(args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "posttrain", "sft", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def _killed_and_resumed(model_dir, tmp_path, *extra) -> tuple[Path, Path]:
    """The same run uninterrupted (``full``) and killed at the start of step 5 (after the step-4 checkpoint),
    then started again with the same command (``killed``)."""
    full = tmp_path / "full" / "run"
    killed = tmp_path / "killed" / "run"
    for run in (full, killed):
        run.parent.mkdir()
    done = _cli(_args(model_dir, full, *extra))
    assert done.returncode == 0, done.stderr[-2000:]
    crashed = _cli(
        _args(model_dir, killed, *extra), env={"POSTTRAIN_TEST_CRASH": f"0:5:{tmp_path / 'crashed'}"}
    )
    assert crashed.returncode == 1, crashed.stderr[-2000:]
    assert [p.name for p in list_checkpoints(killed)] == ["step_000002", "step_000004"]
    assert not (killed / "sft_model").exists()
    resumed = _cli(_args(model_dir, killed, *extra))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resumed from" in resumed.stdout and "(step 4)" in resumed.stdout
    return full, killed


def _same_run(full: Path, killed: Path, weights: str) -> None:
    a = load_file(str(full / "sft_model" / weights))
    b = load_file(str(killed / "sft_model" / weights))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bit-exact
    ran = {m["step"]: m for m in read_metrics(full / "metrics.jsonl")}
    again = {m["step"]: m for m in read_metrics(killed / "metrics.jsonl")}
    assert sorted(ran) == list(range(9))  # step 0: the first validation
    for step in range(5, 9):
        shown = {k: v for k, v in again[step].items() if not k.startswith("timing/")}
        assert shown == {k: v for k, v in ran[step].items() if not k.startswith("timing/")}, step
    assert "val/loss" in again[8]


def test_a_killed_sft_run_resumes_to_the_same_weights_and_metrics(tiny_model_dir, tmp_path):
    full, killed = _killed_and_resumed(tiny_model_dir, tmp_path)
    _same_run(full, killed, "model.safetensors")
    assert [p.name for p in list_checkpoints(full)] == ["step_000006", "step_000008"]  # max_ckpt_to_keep=2


def test_a_killed_lora_sft_run_resumes_to_the_same_adapters(tiny_model_dir, tmp_path):
    full, killed = _killed_and_resumed(tiny_model_dir, tmp_path, "model.lora_rank=4", "model.lora_alpha=8")
    _same_run(full, killed, "adapter_model.safetensors")


def test_a_finished_sft_run_is_refused_unless_its_export_is_missing(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    args = _args(tiny_model_dir, run, "sft.epochs=1")
    assert main(["sft", *args]) == 0
    before = (run / "sft_model" / "model.safetensors").read_bytes()
    info = (run / "run_info.yaml").read_bytes()
    capsys.readouterr()
    assert main(["sft", *args]) == 2
    err = capsys.readouterr().err
    assert "already holds a finished SFT run (checkpoint at step 4" in err and "trainer.resume=disable" in err
    assert (run / "run_info.yaml").read_bytes() == info  # a refused rerun writes nothing
    shutil.rmtree(run / "sft_model")
    assert main(["sft", *args]) == 0  # the export a kill left missing, from the last checkpoint
    assert "without a complete" in capsys.readouterr().out
    assert (run / "sft_model" / "model.safetensors").read_bytes() == before
