"""A hung rank ends the whole job within trainer.dist_timeout_s plus a few seconds, and the failure is
recognised by exception type (DistError) or gloo's own error text, not by any mention of "timeout"."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from posttrain.parallel.runtime import is_collective_failure

pytestmark = pytest.mark.timeout(600)  # the subprocesses have their own deadlines too

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("hung_rank_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_collective_failures_are_recognised_by_type_and_gloo_text():
    assert is_collective_failure(dist.DistBackendError("NCCL watchdog"))
    assert is_collective_failure(dist.DistNetworkError("store gone"))
    gloo = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"
    assert is_collective_failure(RuntimeError(gloo))
    assert is_collective_failure(RuntimeError("Application timeout caused pair closure"))
    # A user's or library's own error that merely mentions a timeout is not a collective failure.
    assert not is_collective_failure(RuntimeError("reward function timed out"))
    assert not is_collective_failure(ValueError("gloo/transport"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun with gloo on loopback")
def test_a_hung_rank_ends_the_job_promptly(tmp_path):
    timeout_s = 10
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        str(WORKER),
        str(timeout_s),
    ]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "TORCH_CPP_LOG_LEVEL": "ERROR",
    }
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "rank 1 hangs" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the job ended before rank 1 hung"
            assert time.monotonic() < deadline, "the job did not start"
        hung_at = time.monotonic()
        output, _ = proc.communicate(timeout=timeout_s + 60)
        took = time.monotonic() - hung_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "another rank has probably died or hung" in output, output[-3000:]
    assert "unreachable" not in output
    assert took < timeout_s + 10, f"the job took {took:.0f} s to end after rank 1 hung"
