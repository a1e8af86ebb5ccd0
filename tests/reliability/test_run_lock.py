"""One run per run directory: a second `posttrain train` (sft, rm, eval) on a locked run_dir exits 2 naming the
holder and writes nothing; a lock whose holder died is taken over; an export directory outside the run
directory (sft.output_dir, rm.output_dir) is locked too."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.config.errors import ConfigError
from posttrain.utils.run_lock import RunDirLock, lock_output_dir
from tests.helpers import rm_cli_args, sft_cli_args, small_overrides

ROOT = Path(__file__).resolve().parents[2]
HOLD = "import sys, time\nfrom posttrain.utils.run_lock import RunDirLock\nlock = RunDirLock(sys.argv[1]).acquire()\nprint('held', flush=True)\ntime.sleep(120)\n"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture
def holder(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True, env=_env()
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        yield run, proc
    finally:
        proc.kill()
        proc.wait()


def test_second_train_on_a_locked_run_dir_exits_2_naming_the_holder(holder, tiny_model_dir):
    run, proc = holder
    config = run / "config.yaml"
    config.write_text("sentinel: the first run's config\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "posttrain",
            "train",
            f"trainer.run_dir={run}",
            f"model.path={tiny_model_dir}",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert f"pid {proc.pid}" in result.stderr and socket.gethostname() in result.stderr
    assert "Traceback" not in result.stderr
    assert config.read_text() == "sentinel: the first run's config\n"  # nothing overwritten


def test_a_lock_whose_holder_died_is_taken_over(holder):
    run, proc = holder
    with pytest.raises(ConfigError, match=f"pid {proc.pid}"):
        RunDirLock(run).acquire()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lock = RunDirLock(run).acquire()
    try:
        assert lock.replaced_stale["pid"] == proc.pid
    finally:
        lock.release()
    with RunDirLock(run):  # released: free again
        pass


def _rm_args(run: Path, model_dir: Path) -> list[str]:
    rows = "\n".join(
        json.dumps({"prompt": f"What is {i} + 1?", "chosen": str(i + 1), "rejected": str(i)})
        for i in range(8)
    )
    data = run.parent / "pairs.jsonl"
    data.write_text(rows)
    return [f"model.path={model_dir}", f"trainer.run_dir={run}", f"data.train_files=[{data}]"]


@pytest.mark.parametrize("command", ["sft", "train", "rm"])
def test_every_command_that_writes_a_run_dir_takes_the_same_lock(holder, tiny_model_dir, command):
    """Drill: a second sft (or a train) into a directory another run holds used to run beside it, interleaving
    metrics.jsonl and overwriting run_info.yaml and the model; it is refused (exit 2) and writes nothing."""
    run, proc = holder
    args = (
        sft_cli_args(run, tiny_model_dir)
        if command == "sft"
        else _rm_args(run, tiny_model_dir)
        if command == "rm"
        else [
            f"trainer.run_dir={run}",
            f"model.path={tiny_model_dir}",
        ]
    )
    before = sorted(p.name for p in run.iterdir())
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", command, *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert f"pid {proc.pid}" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in run.iterdir()) == before  # no metrics, run_info.yaml or model written


def test_sft_holds_the_lock_while_it_runs(tmp_path, tiny_model_dir):
    """sft takes the lock through the same entry point as train: while it runs, nobody else gets it."""
    from posttrain.config.load import build_config
    from posttrain.sft import command

    run = tmp_path / "run"
    cfg = build_config(overrides=sft_cli_args(run, tiny_model_dir))
    seen = []
    real = command._sft

    def probe(*args, **kwargs):
        with pytest.raises(ConfigError, match=f"pid {os.getpid()}"):
            RunDirLock(run).acquire()
        seen.append(True)
        return real(*args, **kwargs)

    command._sft = probe
    try:
        command.run_sft_command(cfg, quiet=True)
        # sft.output_dir outside the run directory: held too while the run writes it
        out = tmp_path / "elsewhere" / "model"
        cfg = build_config(
            overrides=[*sft_cli_args(tmp_path / "run2", tiny_model_dir), f"sft.output_dir={out}"]
        )

        def probe_output(*args, **kwargs):
            with pytest.raises(ConfigError, match=f"sft.output_dir={out} is in use by pid {os.getpid()}"):
                lock_output_dir(out, "sft.output_dir", tmp_path / "run3")
            seen.append(True)
            return real(*args, **kwargs)

        command._sft = probe_output
        command.run_sft_command(cfg, quiet=True)
    finally:
        command._sft = real
    assert len(seen) == 2 and (run / "sft_model" / "config.json").exists() and (out / "config.json").exists()
    with RunDirLock(run):  # released at the end
        pass


@pytest.mark.parametrize("command", ["sft", "rm"])
def test_a_second_run_exporting_to_the_same_output_dir_is_refused(tmp_path, tiny_model_dir, command, capsys):
    """Drill: two sft runs with different trainer.run_dir and the same sft.output_dir both exited 0, the last
    one replacing the other's model. The output directory is held (as the first run holds it while it runs);
    the second exits 2 naming the holder and the key, and writes no model."""
    out, key = tmp_path / "shared_model", f"{command}.output_dir"
    first = lock_output_dir(out, key, tmp_path / "first" / "run")
    second = tmp_path / "second" / "run"
    second.parent.mkdir()
    args = rm_cli_args(second, tiny_model_dir) if command == "rm" else sft_cli_args(second, tiny_model_dir)
    try:
        assert main([command, *args, f"{key}={out}"]) == 2
    finally:
        first.release()
    err = capsys.readouterr().err
    assert f"{key}={out} is in use by pid {os.getpid()}" in err and "Traceback" not in err
    assert not out.exists() and not (second / "metrics.jsonl").exists()


def test_eval_takes_the_run_lock_of_the_directory_it_writes(holder, tiny_model_dir, capsys):
    """Drill: eval took no lock and wrote eval_samples.jsonl into the directory of a training run while it
    ran. It holds trainer.run_dir's lock: refused (exit 2, naming the holder) while another run holds it."""
    run, proc = holder
    assert main(["eval", *small_overrides(tiny_model_dir, run)]) == 2
    err = capsys.readouterr().err
    assert f"pid {proc.pid}" in err and "Traceback" not in err
    assert not (run / "eval_samples.jsonl").exists()
