"""Two nodes on this machine: each a launcher process tree of its own (`torchrun --nnodes 2 --node_rank N`),
meeting in a c10d rendezvous on loopback, as two machines would meet on a network.

The rendezvous store is served by the test process on 127.0.0.1 (tests/parallel/conftest.py's
``loopback_rendezvous``); both launchers join it as clients and bind to 127.0.0.1 (``--local-addr``), and the
ranks build their own process group's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE, which ``loopback_env`` sets),
so every socket of the job listens on loopback. With c10d the rendezvous, not ``--node_rank``, decides which
node holds rank 0: the nodes are sorted by (address, launcher pid), so here the launcher started first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.parallel.conftest import REPO, end_group, loopback_env, loopback_rendezvous, start_group


def node_command(
    node_rank: int, nproc: int, rendezvous_port: int, *target: str, nnodes: int = 2, join_timeout_s: int = 60
) -> list[str]:
    """One node's launcher: ``nproc`` ranks of ``target`` in a job of ``nnodes`` nodes."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--node_rank={node_rank}",
        f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{rendezvous_port}",
        "--rdzv-id=two-nodes",
        f"--rdzv-conf=is_host=false,join_timeout={join_timeout_s}",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",
        *target,
    ]


@dataclass
class Node:
    """One launcher process tree, its output going to a file (no pipe to fill while the test waits)."""

    rank: int
    proc: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def nodes(
    target: list[str],
    out: Path,
    nnodes: int = 2,
    nproc: int = 1,
    join: int | None = None,
    join_timeout_s: int = 60,
    **env: str,
) -> Iterator[list[Node]]:
    """Start ``nnodes`` launchers of ``target`` (``join`` of them only, to leave the others' seats empty), node
    rank order = start order; every process they started is killed when the block ends."""
    out.mkdir(parents=True, exist_ok=True)
    started: list[Node] = []
    with loopback_rendezvous() as port:
        try:
            for rank in range(nnodes if join is None else join):
                log = out / f"node{rank}.log"
                with log.open("w") as sink:
                    proc = start_group(
                        node_command(
                            rank, nproc, port, *target, nnodes=nnodes, join_timeout_s=join_timeout_s
                        ),
                        env=loopback_env(**env),
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                        cwd=REPO,
                    )
                started.append(Node(rank, proc, log))
                time.sleep(0.5)  # distinct start order: the first launcher becomes rank 0's node
            yield started
        finally:
            for node in started:
                # torchrun starts each rank in a session of its own: a launcher's group does not hold them.
                for pid in children(node.proc.pid):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                end_group(node.proc)


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (a launcher's ranks), read from /proc; empty when it is gone."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def wait_all(started: list[Node], timeout: float) -> list[int]:
    """Every launcher's exit code, waiting at most ``timeout`` seconds in all (TimeoutExpired past it)."""
    deadline = time.monotonic() + timeout
    return [node.proc.wait(timeout=max(0.1, deadline - time.monotonic())) for node in started]


def wait_or_fail(started: list[Node], timeout: float, grace_s: float = 30.0) -> list[int | None]:
    """Every launcher's exit code; once one has failed, the others get ``grace_s`` more seconds (None: still
    running, then killed), so a node that died early does not leave the test waiting out the whole timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [node.proc.poll() for node in started]
        if all(c is not None for c in codes):
            return codes
        if any(c not in (None, 0) for c in codes):
            deadline = min(deadline, time.monotonic() + grace_s)
        time.sleep(0.2)
    return [node.proc.poll() for node in started]


# torchrun's agent picks MASTER_PORT free, and rank 0 binds it only later: on a busy machine another process may
# take it in between, a race of the launcher's, not of the code under test. Such a run is tried once more.
PORT_TAKEN = "Address already in use"


def run_on_nodes(
    target: list[str], out: Path, nnodes: int = 2, nproc: int = 1, timeout: float = 300
) -> list[str]:
    """Run ``target`` on ``nnodes`` nodes to the end; each node's output. Fails with the outputs when a
    launcher fails (a run that lost its port to another process is run again once)."""
    for attempt in range(2):
        with nodes(target, out, nnodes=nnodes, nproc=nproc) as started:
            codes = wait_or_fail(started, timeout)
            outputs = [node.output() for node in started]
        lost_port = any(c not in (0, None) and PORT_TAKEN in o for c, o in zip(codes, outputs))
        if not (lost_port and attempt == 0):
            break
    assert codes == [0] * nnodes, "\n".join(
        f"--- node {i} (exit {c})\n{o[-4000:]}" for i, (c, o) in enumerate(zip(codes, outputs))
    )
    return outputs
