"""Where a process group's sockets listen: on loopback when every rank runs on this machine.

A process group opens two kinds of listening sockets. Rank 0 hosts torch's rendezvous store (a TCPStore on
``MASTER_PORT``; whoever reaches it can read and write the keys the ranks use to find each other), and every
rank's gloo device listens for its peers' connections. torch 2.13 binds the store's server to every interface
(``::``) whatever ``MASTER_ADDR`` says: the host name is only where the clients connect, for both the libuv
and the classic server, and no ``TORCH_*`` variable changes it. The one way torch offers is to hand the server
a socket that already listens (``TCPStore(master_listen_fd=...)``; both servers take it over and close it with
the store). gloo binds to the address of ``GLOO_SOCKET_IFNAME`` (else to whatever the host name resolves to).

So when ``MASTER_ADDR`` is a loopback address (all ranks on this machine: nobody else could reach it) rank 0
opens the store's socket on that address itself and every rank builds its store client to match
(:func:`loopback_store`), and gloo is bound to the loopback interface (:func:`loopback_gloo_env`). Left to
torch: a network ``MASTER_ADDR`` (other nodes must reach the store), and ranks whose launcher hosts the store
(torchrun's agent sets ``TORCHELASTIC_USE_AGENT_STORE=True``; its store, in the torchrun process, listens on
every interface: docs/distributed.md).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import sys
from typing import Any

from torch.distributed import TCPStore

from posttrain.config.errors import ConfigError

# torchrun's agent hosts the store and tells its workers so with this variable (torch.distributed.rendezvous).
AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP literal or ``localhost``) is this machine's loopback."""
    if address == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:  # a host name: it may resolve anywhere
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def loopback_gloo_env(master_addr: str) -> dict[str, str]:
    """gloo's interface for ranks whose rank 0 listens on ``master_addr``: loopback when that is a loopback
    address (all ranks on this machine), else whatever gloo picks."""
    if not is_loopback(master_addr):
        return {}
    return {"GLOO_SOCKET_IFNAME": "lo" if sys.platform.startswith("linux") else "lo0"}


def loopback_store(
    master_addr: str, master_port: int, rank: int, world_size: int, timeout: datetime.timedelta
) -> TCPStore | None:
    """The rendezvous store of a group whose rank 0 listens on a loopback ``master_addr``, with its server
    (on rank 0) listening on that address only; None where torch's own rendezvous must build it (a network
    address, or a launcher that hosts the store). Every rank calls it with the same arguments: rank 0
    serves, the others connect.

    Raises ConfigError when rank 0 cannot listen on ``MASTER_ADDR:MASTER_PORT`` (the port is taken)."""
    if os.environ.get(AGENT_STORE_VARIABLE) == "True" or not is_loopback(master_addr):
        return None
    # "localhost" may resolve to ::1 on one rank's lookup and 127.0.0.1 on another's: use one literal.
    host = "127.0.0.1" if master_addr == "localhost" else master_addr
    options = dict(world_size=world_size, timeout=timeout)
    if rank != 0:
        return TCPStore(host, master_port, is_master=False, **options)
    fd = _listening_fd(host, master_port)
    return TCPStore(host, master_port, is_master=True, master_listen_fd=fd, **options)


def _listening_fd(host: str, port: int) -> int:
    """A socket listening on ``host:port`` only, handed over as a bare descriptor (the store owns it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As torch's own server does: a port whose last connections are still in TIME_WAIT can be reused.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"rank 0 cannot listen on MASTER_ADDR={host} MASTER_PORT={port} for the ranks' rendezvous "
            f"({exc.strerror}); choose a free MASTER_PORT (another run may be using this one)"
        ) from None
    return sock.detach()


def local_rendezvous(rank: int, world: int, timeout: datetime.timedelta) -> dict[str, Any]:
    """``init_process_group``'s rendezvous arguments for a rank launched with MASTER_ADDR/MASTER_PORT: when
    every rank runs on this machine (a loopback MASTER_ADDR that every rank was given: :func:`one_master_address`),
    the store of :func:`loopback_store` and gloo bound to the loopback interface (a GLOO_SOCKET_IFNAME
    the user set stays); empty otherwise (torch's env:// rendezvous, as torchrun or the user set it up)."""
    master_addr = os.environ.get("MASTER_ADDR", "")
    if not one_master_address(world):
        # Ranks on other nodes, maybe told another address for rank 0 (torchrun's --master_addr is per node).
        return {}
    for name, value in loopback_gloo_env(master_addr).items():
        os.environ.setdefault(name, value)
    port = os.environ.get("MASTER_PORT")
    store = loopback_store(master_addr, int(port), rank, world, timeout) if port else None
    return {} if store is None else {"store": store, "rank": rank, "world_size": world}


def one_master_address(world: int) -> bool:
    """Whether every rank was given this rank's MASTER_ADDR, so that a loopback one means every rank runs on this
    machine: all ranks on one node (LOCAL_WORLD_SIZE, where set, the world), or ranks on several nodes started
    by torchrun's dynamic (c10d) rendezvous without its shared store (TORCHELASTIC_USE_AGENT_STORE=False): there
    rank 0's launcher publishes its own address to every node's launcher. (A static rendezvous always shares its
    store, and each node's --master_addr is that node's own word.)"""
    return (
        int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world
        or os.environ.get(AGENT_STORE_VARIABLE) == "False"
    )
