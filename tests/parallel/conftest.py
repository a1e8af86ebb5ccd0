"""Launch real multi-process jobs (torchrun, gloo on loopback) from tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).with_name("workers.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_env(**extra: str) -> dict[str, str]:
    """Bind gloo to loopback (the machine may have no other usable interface) and keep ranks single-threaded:
    two ranks spinning OpenMP threads on two cores slow each other down many times over."""
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
        TORCH_CPP_LOG_LEVEL="ERROR",
    )
    env.update(extra)
    return env


def torchrun(nproc: int, scenario: str, out: Path, options: dict, timeout: float = 240, check: bool = True):
    """Run ``workers.py <scenario>`` on ``nproc`` ranks; returns the CompletedProcess."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(WORKERS),
        scenario,
        str(out),
        *[f"{k}={v}" for k, v in options.items()],
    ]
    proc = subprocess.run(cmd, env=loopback_env(), capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if check and proc.returncode != 0:
        pytest.fail(
            f"torchrun {scenario} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc
