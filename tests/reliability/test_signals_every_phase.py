"""Drills: SIGTERM during `posttrain sft`, `posttrain eval`, the final export or the built-in model's warm start
ended the process with no message (rc -15), and eval's orphaned reward worker printed a BrokenPipeError
traceback; Ctrl-C in sft and in the warm start said "the last complete checkpoint is intact" with no
checkpoint. Now every phase ends with one line saying what it left behind, exit 143 (SIGTERM) or 130
(SIGINT), and no worker traceback. The signal is sent to this process from inside the phase."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.rl import train_command
from posttrain.rm import command as rm_command
from posttrain.sft import builtin
from posttrain.sft import command as sft_command
from posttrain.train import loop
from posttrain.utils.storage import model_dir_complete
from tests.helpers import rm_cli_args, sft_cli_args, small_overrides

EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}
SAID = {signal.SIGTERM: "terminated (SIGTERM); ", signal.SIGINT: "interrupted; "}


@pytest.fixture(autouse=True)
def _ctrl_c_as_in_a_shell():
    """Ctrl-C's handler as a command started from a shell has it (KeyboardInterrupt): a pytest-xdist worker starts
    with SIGINT ignored, which posttrain leaves as it finds it (a process started ignoring SIGINT keeps ignoring it)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _signal_self(signum: int = signal.SIGTERM):
    def send(*args, **kwargs):
        os.kill(os.getpid(), signum)
        time.sleep(10)  # the handler raises here
        raise AssertionError(f"{signum!r} did not stop the phase")

    return send


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("posttrain ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


EXPORTS = {  # command: (module, its export function, arguments, the export directory)
    "train": (train_command, "export_policy", "final_model"),
    "sft": (sft_command, "export_policy", "sft_model"),
    "rm": (rm_command, "export_reward_model", "reward_model"),
}


def _args(command: str, run, model_dir) -> list[str]:
    if command == "rm":
        return rm_cli_args(run, model_dir, "rm.max_steps=2")
    if command == "sft":
        return sft_cli_args(run, model_dir)
    return small_overrides(model_dir, run, "trainer.total_steps=1", "trainer.export_hf=true")


@pytest.mark.parametrize("command", sorted(EXPORTS))
def test_sigterm_during_the_final_export_says_so_and_the_rerun_finishes_it(
    command, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    module, name, out = EXPORTS[command]
    run = tmp_path / "run"
    monkeypatch.setattr(module, name, _signal_self())
    assert main([command, *_args(command, run, tiny_model_dir)]) == 143
    line = _one_line(capsys.readouterr().err)
    assert f"terminated (SIGTERM); the export to {run / out} was not finished" in line
    assert "run the same command to finish the export" in line
    assert not (run / out).exists() and not list(run.glob(f".{out}.partial-*"))
    monkeypatch.undo()
    assert main([command, *_args(command, run, tiny_model_dir)]) == 0
    assert model_dir_complete(run / out)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_in_sft_names_the_checkpoint_left_or_that_there_is_none(
    signum, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    args = [*sft_cli_args(run, tiny_model_dir, rows=16), "trainer.save_freq=2"]  # 4 steps
    at = {1: _signal_self(signum), 3: _signal_self(signum)}

    def signal_at(step: int, rank: int) -> None:
        if step in at:
            at.pop(step)()

    monkeypatch.setattr(loop, "crash_if_asked", signal_at)
    assert main(["sft", *args]) == EXIT[signum]
    line = _one_line(capsys.readouterr().err)
    assert SAID[signum] + "no checkpoint had been written yet: run the same command to start again" in line
    assert main(["sft", *args]) == EXIT[signum]  # now at step 3, after the checkpoint of step 2
    line = _one_line(capsys.readouterr().err)
    assert SAID[signum] + "the last complete checkpoint is intact (" in line and "step_000002" in line


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_in_the_builtin_warm_start_says_nothing_was_cached(signum, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("POSTTRAIN_CACHE", str(cache))
    monkeypatch.setattr(builtin, "run_sft", _signal_self(signum))
    args = ["model.path=builtin:tiny", f"trainer.run_dir={tmp_path / 'run'}", "data.num_val_examples=4"]
    assert main(["eval", *args]) == EXIT[signum]
    line = _one_line(capsys.readouterr().err)
    assert SAID[signum] + "the built-in model's SFT warm start was stopped before it was cached" in line
    assert "checkpoint" not in line
    assert not [p for p in cache.iterdir() if "sft" in p.name]  # neither the model nor a half-built one


TERM_PARENT = """
import os, signal, time

def term_parent(prompt, response, ground_truth, extra):
    os.kill(os.getppid(), signal.SIGTERM)  # the trainer is stopped while this worker scores
    time.sleep(2)
    return 0.0
"""


def test_sigterm_during_eval_stops_its_reward_workers_without_a_traceback(tiny_model_dir, tmp_path, capfd):
    reward = tmp_path / "term_parent.py"
    reward.write_text(TERM_PARENT)
    run = tmp_path / "run"
    args = [
        *small_overrides(tiny_model_dir, run, "data.num_val_examples=2"),
        "reward.timeout_s=30",
        f"reward.function={reward}:term_parent",
    ]
    assert main(["eval", *args]) == 143
    time.sleep(3)  # a worker left behind would now write into the closed pipe
    err = capfd.readouterr().err
    line = _one_line(err)
    assert "terminated (SIGTERM); eval stopped before its results were written" in line
    assert "BrokenPipeError" not in err
    assert not (run / "eval_samples.jsonl").exists()


KILLED_WHILE_SCORING = """
import time
from posttrain.rewards.runner import RewardInput, RewardRunner

def slow(prompt, response, ground_truth, extra):
    time.sleep(2)
    return 1.0

runner = RewardRunner(slow, timeout_s=30)
print("scoring", flush=True)
runner.score([RewardInput("p", "r")])
"""


def test_a_reward_worker_whose_trainer_was_killed_exits_without_a_traceback(tmp_path):
    """Drill: the worker of a killed trainer answered into the closed pipe and printed a BrokenPipeError
    traceback. The trainer here is SIGKILLed (no cleanup at all) while its worker scores."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WHILE_SCORING], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert proc.stdout.readline().strip() == b"scoring"
    time.sleep(0.5)  # the worker is inside the call
    proc.kill()
    proc.wait()
    err = proc.stderr.read().decode()  # returns once the worker, which shares the pipe, is gone too
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
