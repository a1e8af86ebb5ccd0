"""Launch real multi-process jobs (torchrun, its store and gloo on loopback) from tests."""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from posttrain.parallel.rendezvous import loopback_store

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
        # torchrun's dynamic rendezvous would serve the ranks' store from its agent, on every interface.
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    env.update(extra)
    return env


@contextlib.contextmanager
def loopback_rendezvous() -> Iterator[int]:
    """A rendezvous store for torchrun, served by this process on loopback for as long as the block runs;
    yields its port. (torchrun's own store listens on every interface: tests/parallel/test_rendezvous.py.)"""
    port = free_port()
    store = loopback_store("127.0.0.1", port, 0, 1, datetime.timedelta(seconds=600))
    try:
        yield port
    finally:
        del store


def torchrun_command(nproc: int, rendezvous_port: int, *target: str) -> list[str]:
    """`python -m torch.distributed.run` on ``nproc`` local ranks running ``target``, listening on loopback
    only: its agent joins the store at ``rendezvous_port`` (:func:`loopback_rendezvous`) instead of serving
    one, and rank 0 serves the ranks' store (posttrain's, or the workers' through ``local_rendezvous``), which
    :func:`loopback_env` asks for (TORCH_DISABLE_SHARE_RDZV_TCP_STORE) and binds to 127.0.0.1 (--local-addr)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{rendezvous_port}",
        "--rdzv-conf=is_host=false",
        "--local-addr=127.0.0.1",
        *target,
    ]


def torchrun(nproc: int, scenario: str, out: Path, options: dict, timeout: float = 240, check: bool = True):
    """Run ``workers.py <scenario>`` on ``nproc`` ranks; returns the CompletedProcess."""
    out.mkdir(parents=True, exist_ok=True)
    args = [str(WORKERS), scenario, str(out), *[f"{k}={v}" for k, v in options.items()]]
    ray_dir = tempfile.mkdtemp(prefix="ray-")  # where a rank that starts Ray puts its files (short: sockets)
    env = loopback_env(RAY_TMPDIR=ray_dir)
    with loopback_rendezvous() as port:
        cmd = torchrun_command(nproc, port, *args)
        proc = start_group(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            end_group(proc)
            shutil.rmtree(ray_dir, ignore_errors=True)
    proc = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        pytest.fail(
            f"torchrun {scenario} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


# Kills the process group named on its command line once its stdin closes: when the test process closes it, or
# dies, however (SIGKILL included).
REAPER = """
import os, signal, sys
sys.stdin.buffer.read()
try:
    os.killpg(int(sys.argv[1]), signal.SIGKILL)
except OSError:
    pass
"""


def start_group(cmd: list[str], **popen) -> subprocess.Popen:
    """Popen in a process group of its own (torchrun, its ranks and whatever they start, Ray included),
    which ends with :func:`end_group` or with this process, whichever comes first."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    proc.reaper = subprocess.Popen(  # type: ignore[attr-defined]
        [sys.executable, "-c", REAPER, str(proc.pid)], stdin=subprocess.PIPE, start_new_session=True
    )
    return proc


def end_group(proc: subprocess.Popen) -> None:
    """Kill what is left of the group (nothing, after a clean exit), and the reaper."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.reaper.stdin.close()  # type: ignore[attr-defined]
    proc.reaper.wait()  # type: ignore[attr-defined]
