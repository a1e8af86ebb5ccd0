"""One run per run directory: a second `posttrain train` on a locked run_dir exits 2 naming the holder and
writes nothing; a lock whose holder died is taken over."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config.errors import ConfigError
from posttrain.utils.run_lock import RunDirLock

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
