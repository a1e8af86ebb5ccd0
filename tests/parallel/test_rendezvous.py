"""Where a process group listens. Ranks that all run on this machine (a loopback MASTER_ADDR, as posttrain
sets for the ranks it places itself) listen on loopback only: rank 0's rendezvous store and every rank's
gloo. torch's own store listens on every interface whatever host it is given, and so does torchrun's agent,
which hosts the store of the ranks it starts (docs/distributed.md): these tests pin both, so the docs change
when torch does. Linux only (they read /proc)."""

import datetime
import os
import socket
import subprocess
import sys

import pytest
from torch.distributed import TCPStore

from posttrain.config.errors import ConfigError
from posttrain.parallel.rendezvous import (
    AGENT_STORE_VARIABLE,
    is_loopback,
    local_rendezvous,
    loopback_store,
    one_master_address,
)
from tests.parallel.conftest import (
    REPO,
    end_group,
    free_port,
    loopback_env,
    loopback_rendezvous,
    start_group,
    torchrun_command,
)
from tests.sockets import is_loopback as listens_on_loopback
from tests.sockets import listening_addresses, listening_sockets

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
    pytest.mark.timeout(300),
]
TIMEOUT = datetime.timedelta(seconds=60)

# One rank: joins the group as posttrain's trainer does, says its pid once every rank is in, and leaves when
# the test closes its stdin.
RANK = """
import os, sys, torch
from posttrain.parallel.runtime import init_distributed, shutdown_distributed
ctx = init_distributed(torch.device("cpu"), 60)
ctx.barrier()
# one write (atomic on a pipe): under torchrun both ranks share one stdout, and print's pieces interleaved
os.write(1, f"{os.getpid()} {os.environ.get('GLOO_SOCKET_IFNAME', '-')}\\n".encode())
sys.stdin.read()
ctx.barrier()
shutdown_distributed(ctx)
"""


def _new_addresses(before: dict[str, str]) -> list[str]:
    return sorted(a for inode, a in listening_sockets(os.getpid()).items() if inode not in before)


def test_addresses_on_this_machine():
    assert all(is_loopback(a) for a in ("127.0.0.1", "127.0.1.1", "localhost", "::1", "::ffff:127.0.0.1"))
    assert not any(is_loopback(a) for a in ("10.0.0.1", "0.0.0.0", "::", "node-1", "192.0.2.2"))


def test_the_store_of_ranks_on_this_machine_listens_on_loopback_only():
    before = listening_sockets(os.getpid())
    port = free_port()
    server = loopback_store("127.0.0.1", port, 0, 1, TIMEOUT)  # a world of one: it waits for no client
    client = loopback_store("localhost", port, 1, 2, TIMEOUT)  # the same literal: 127.0.0.1
    client.set("key", "value")
    assert server.get("key") == b"value"
    assert _new_addresses(before) == [f"127.0.0.1:{port}"]
    del client, server
    assert _new_addresses(before) == []  # the store closed the socket it was handed


def test_torchs_own_store_listens_everywhere():
    """Why posttrain builds the store itself: given 127.0.0.1, torch 2.13 still listens on every interface."""
    before = listening_sockets(os.getpid())
    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=TIMEOUT)
    try:
        assert _new_addresses(before) in ([f"::{':'}{store.port}"], [f"0.0.0.0:{store.port}"])
    finally:
        del store


def test_torch_builds_the_store_for_network_addresses_and_launcher_hosted_stores(monkeypatch):
    monkeypatch.delenv(AGENT_STORE_VARIABLE, raising=False)
    assert loopback_store("10.0.0.1", free_port(), 0, 2, TIMEOUT) is None  # other nodes must reach it
    monkeypatch.setenv(AGENT_STORE_VARIABLE, "True")  # torchrun's agent hosts it; the ranks are clients
    assert loopback_store("127.0.0.1", free_port(), 0, 2, TIMEOUT) is None


def test_ranks_on_other_nodes_keep_torchs_rendezvous(monkeypatch):
    """A loopback MASTER_ADDR on a node whose ranks are not the whole world (torchrun's --master_addr is per
    node): the other nodes' ranks must reach rank 0, so neither the store nor gloo is bound to loopback."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv(AGENT_STORE_VARIABLE, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_rendezvous(0, 4, TIMEOUT) == {}
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_which_launches_give_every_rank_one_master_address(monkeypatch):
    """One node (LOCAL_WORLD_SIZE the world), or torchrun's c10d rendezvous without its shared store (rank 0's
    launcher publishes its address to every node): a loopback MASTER_ADDR then means every rank is on this
    machine. A static rendezvous (which always shares its store) or ranks started by hand on several nodes:
    each node may have been told its own address for rank 0."""
    monkeypatch.delenv(AGENT_STORE_VARIABLE, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert one_master_address(2)
    assert not one_master_address(4)
    monkeypatch.setenv(AGENT_STORE_VARIABLE, "True")
    assert not one_master_address(4)
    monkeypatch.setenv(AGENT_STORE_VARIABLE, "False")  # torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    assert one_master_address(4)


def test_a_taken_port_is_a_config_error():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(
            ConfigError, match=f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port}.*choose a free MASTER_PORT"
        ):
            loopback_store("127.0.0.1", port, 0, 2, TIMEOUT)


def _start_ranks(cmds: list[list[str]], envs: list[dict]) -> list[subprocess.Popen]:
    return [
        start_group(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        for cmd, env in zip(cmds, envs, strict=True)
    ]


def _rank_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", AGENT_STORE_VARIABLE)}
    return env | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"} | extra


@pytest.mark.dist
def test_two_ranks_started_as_posttrain_starts_them_listen_on_loopback_only():
    """Two gloo ranks given the environment posttrain gives the ranks it places (RANK, WORLD_SIZE,
    MASTER_ADDR=127.0.0.1, MASTER_PORT), without GLOO_SOCKET_IFNAME."""
    port = str(free_port())
    common = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2")
    envs = [_rank_env(**common, RANK=str(r), LOCAL_RANK=str(r)) for r in range(2)]
    procs = _start_ranks([[sys.executable, "-c", RANK]] * 2, envs)
    try:
        said = [proc.stdout.readline().split() for proc in procs]
        assert [s[1] for s in said] == ["lo", "lo"], said  # gloo bound to loopback by default
        listening = listening_addresses([int(s[0]) for s in said])
        for proc in procs:
            proc.stdin.close()
        assert [proc.wait(timeout=60) for proc in procs] == [0, 0]
    finally:
        for proc in procs:
            end_group(proc)
    addresses = [a for found in listening.values() for a in found]
    assert f"127.0.0.1:{port}" in listening[int(said[0][0])]  # rank 0's store
    assert len(addresses) >= 3, listening  # the store and each rank's gloo: they were read
    assert all(listens_on_loopback(a) for a in addresses), listening


def _torchrun(nproc: int, *target: str, rendezvous: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *rendezvous, *target]
    env = _rank_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return start_group(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)


def _listening_under_torchrun(proc: subprocess.Popen) -> dict[int, list[str]]:
    """What the agent (first) and its two ranks listen on once the ranks are in their group."""
    try:
        said = [proc.stdout.readline().split() for _ in range(2)]
        assert [s[1] for s in said] == ["lo", "lo"], said
        listening = listening_addresses([proc.pid, *(int(s[0]) for s in said)])
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        end_group(proc)
    return listening


@pytest.mark.dist
def test_under_a_plain_torchrun_the_ranks_listen_on_loopback_and_the_agent_everywhere(tmp_path):
    """torchrun's default (static) rendezvous: its agent serves the ranks' store with torch's own store, on
    every interface, and the ranks are its clients."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = free_port()
    proc = _torchrun(2, str(script), rendezvous=["--master_addr=127.0.0.1", f"--master_port={port}"])
    listening = _listening_under_torchrun(proc)
    agent = listening.pop(proc.pid)
    assert agent in ([f"::{':'}{port}"], [f"0.0.0.0:{port}"]), agent  # the exposure docs/distributed.md names
    addresses = [a for found in listening.values() for a in found]
    assert len(addresses) >= 2 and all(listens_on_loopback(a) for a in addresses), listening


@pytest.mark.dist
def test_the_tests_torchrun_listens_on_loopback_only(tmp_path):
    """The tests' torchrun (tests/parallel/conftest.py): the agent joins a store this process serves on
    loopback, and rank 0 serves the ranks' store, on loopback too."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    with loopback_rendezvous() as port:
        cmd = torchrun_command(2, port, str(script))
        proc = start_group(
            cmd, env=loopback_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
        )
        listening = _listening_under_torchrun(proc)
    assert listening.pop(proc.pid) == []  # the agent serves nothing
    addresses = [a for found in listening.values() for a in found]
    assert len(addresses) >= 3 and all(listens_on_loopback(a) for a in addresses), listening
