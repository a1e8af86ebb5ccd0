"""The TCP sockets a process listens on, read from /proc (Linux only; no `ss`): the socket inodes among its
descriptors (/proc/PID/fd) looked up in the TCP tables of its network namespace (/proc/PID/net/tcp and tcp6,
state 0A: LISTEN)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
from pathlib import Path


def listening_sockets(pid: int) -> dict[str, str]:
    """``{socket inode: "ip:port"}`` of every TCP socket process ``pid`` holds open and listens on; empty
    when the process is gone."""
    try:
        tables = _listening_table(pid)
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone
        return {}
    inodes = []
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.append(link[len("socket:[") : -1])
    return {inode: tables[inode] for inode in inodes if inode in tables}


def listening_addresses(pids: list[int]) -> dict[int, list[str]]:
    """The addresses (``ip:port``) each of ``pids`` listens on (a process that is gone is left out)."""
    out = {}
    for pid in pids:
        if Path(f"/proc/{pid}").exists():
            out[pid] = sorted(listening_sockets(pid).values())
    return out


def is_loopback(address: str) -> bool:
    """Whether an ``ip:port`` from :func:`listening_sockets` is on loopback (IPv4-mapped IPv6 included)."""
    ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _listening_table(pid: int) -> dict[str, str]:
    table = {}
    for name, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                ip_hex, port_hex = fields[1].split(":")
                table[fields[9]] = f"{_ip(ip_hex, width)}:{int(port_hex, 16)}"
    return table


def _ip(hex_ip: str, width: int) -> str:
    """/proc/net/tcp's address: 32-bit words in host (little-endian) order."""
    words = [bytes.fromhex(hex_ip[i : i + 8])[::-1] for i in range(0, width, 8)]
    return str(ipaddress.ip_address(b"".join(words)))
