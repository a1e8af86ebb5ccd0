"""SIGTERM ends a run like Ctrl-C (one line, exit 143, checkpoint intact, resumable); with
trainer.save_on_terminate it first saves the current step; no signal interrupts a checkpoint save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.train.checkpoint import list_checkpoints
from posttrain.utils.signals import RunSignals, Terminated
from tests.helpers import read_metrics, small_overrides

pytestmark = [pytest.mark.long, pytest.mark.timeout(600)]  # the subprocesses have their own deadlines too

ROOT = Path(__file__).resolve().parents[2]


def _train(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "posttrain", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for_step(proc: subprocess.Popen, run: Path, timeout_s: float = 120.0) -> int:
    """Poll metrics.jsonl until a step is logged; returns the last logged step."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        path = run / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        steps = [json.loads(line)["step"] for line in lines if line.strip()]
        if steps and steps[-1] >= 1:
            return steps[-1]
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("no step was logged in time")


@pytest.mark.parametrize("save_on_terminate", [False, True])
def test_sigterm_stops_with_143_and_the_run_resumes(tiny_model_dir, tmp_path, save_on_terminate):
    run = tmp_path / "run"
    args = small_overrides(
        tiny_model_dir,
        run,
        "trainer.total_steps=40",
        "trainer.save_freq=1",
        "trainer.export_hf=false",
        f"trainer.save_on_terminate={str(save_on_terminate).lower()}",
    )
    proc = _train(args)
    _wait_for_step(proc, run)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "terminated (SIGTERM)" in err and "intact" in err and "Traceback" not in err
    last_logged = read_metrics(run)[-1]["step"]
    saved = int(list_checkpoints(run)[-1].name.split("_")[1])
    if save_on_terminate:
        assert saved == last_logged  # the step being run when SIGTERM came was finished and saved
    resumed = _train([*args, f"trainer.total_steps={saved + 1}"])
    out, err = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, err
    assert f"step {saved})" in out  # "Resumed from ... (step N)"
    assert read_metrics(run)[-1]["step"] == saved + 1


def test_signals_during_a_save_wait_for_it():
    signals = RunSignals().install()
    done = []
    try:
        with pytest.raises(KeyboardInterrupt), signals.critical():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            done.append("save finished")
        with pytest.raises(Terminated, match="intact"), signals.critical():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            done.append("save finished")
    finally:
        signals.restore()
    assert done == ["save finished", "save finished"]


def test_ctrl_c_during_a_save_gives_the_one_line_message_and_a_complete_checkpoint(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    from posttrain.cli import main
    from posttrain.train import loop
    from posttrain.train.checkpoint import find_checkpoint

    original = loop.save_checkpoint

    def interrupted_save(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # arrives while the checkpoint is being written
        time.sleep(0.05)
        return original(*args, **kwargs)

    monkeypatch.setattr(loop, "save_checkpoint", interrupted_save)
    run = tmp_path / "run"
    args = small_overrides(tiny_model_dir, run, "trainer.total_steps=3", "trainer.save_freq=1")
    assert main(["train", *args]) == 130
    err = capsys.readouterr().err
    assert "interrupted; the last complete checkpoint is intact" in err and "Traceback" not in err
    assert find_checkpoint(run, "auto").name == "step_000001"  # the save finished and verifies
