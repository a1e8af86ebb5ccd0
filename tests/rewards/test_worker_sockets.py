"""A reward worker forked from a trainer that listens (torch's rendezvous store, gloo, any socket of its own)
holds none of those sockets: their descriptors point at /dev/null in the worker, and the worker still talks
to the trainer over its pipe. Linux only (reads /proc)."""

import contextlib
import datetime
import json
import os
import socket
import sys

import pytest
from torch.distributed import TCPStore

from posttrain.rewards.runner import RewardInput, RewardRunner
from posttrain.utils.inherited import drop_listening_sockets
from tests.sockets import listening_sockets

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _descriptors() -> dict[str, str]:
    """This process's descriptors and what each points at."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own, closed by now
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return out


def report_sockets(prompt, response, ground_truth, extra):
    """A reward function that writes what its process holds to ``extra["out"]``."""
    report = {"listening": listening_sockets(os.getpid()), "descriptors": _descriptors()}
    with open(extra["out"], "w") as f:
        json.dump(report, f)
    return 1.0


def test_a_reward_worker_holds_none_of_the_trainers_listening_sockets(tmp_path):
    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=datetime.timedelta(seconds=30))
    own = socket.create_server(("127.0.0.1", 0))
    try:
        trainer = listening_sockets(os.getpid())
        store_port, own_port = store.port, own.getsockname()[1]
        assert any(a.endswith(f":{store_port}") for a in trainer.values()), trainer
        assert any(a.endswith(f":{own_port}") for a in trainer.values()), trainer
        trainer_fds = {fd: link for fd, link in _descriptors().items() if link[8:-1] in trainer}

        out = tmp_path / "worker.json"
        with RewardRunner(report_sockets, timeout_s=30) as runner:
            sample = RewardInput(prompt="p", response="r", extra={"out": str(out)})
            rewards, metrics = runner.score([sample])
            worker = runner._workers[0].process.pid
        assert rewards == [1.0] and metrics["reward/num_failures"] == 0  # the pipe to the trainer works
    finally:
        own.close()
        del store
    report = json.loads(out.read_text())
    assert worker != os.getpid()
    assert report["listening"] == {}
    assert not set(report["descriptors"].values()) & set(trainer_fds.values())
    # The trainer's listening descriptors keep their numbers in the worker, on /dev/null.
    assert {report["descriptors"][fd] for fd in trainer_fds} == {os.devnull}


def test_only_listening_sockets_are_dropped():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports what it dropped and exits without running the parent's cleanup
        status = 1
        try:
            os.write(write_end, json.dumps(drop_listening_sockets()).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    dropped = json.loads(os.read(read_end, 65536))
    _, status = os.waitpid(pid, 0)
    os.close(read_end)
    try:
        assert status == 0
        assert server.fileno() in dropped
        assert client.fileno() not in dropped and accepted.fileno() not in dropped
        client.sendall(b"x")  # the parent's own sockets are untouched
        assert accepted.recv(1) == b"x"
    finally:
        for sock in (client, accepted, server):
            sock.close()
