"""Raw HTTP on loopback for the server's tests: requests byte for byte as a hostile client writes them, and the
answer read without trusting the server to behave (no HTTP library smoothing anything over)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from posttrain.sandbox.build import Sandbox
from posttrain.sandbox.server import SandboxServer


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: Any  # the parsed JSON


@contextlib.contextmanager
def running(backend, max_concurrent: int = 2, **settings) -> Iterator[SandboxServer]:  # noqa: ANN001
    """A server on 127.0.0.1 and an ephemeral port, serving in a thread."""
    server = SandboxServer(("127.0.0.1", 0), Sandbox(backend, max_concurrent), **settings)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def port_of(server: SandboxServer) -> int:
    return server.server_address[1]


def connect(server: SandboxServer, timeout: float = 30.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port_of(server)), timeout=timeout)


def request_bytes(body: Any, headers: dict[str, str] | None = None, path: str = "/run_code") -> bytes:
    """A POST with ``body`` (bytes as is, anything else as JSON) and a correct Content-Length unless
    ``headers`` sets one (or sets it to None: no Content-Length at all)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    fields = {"Host": "127.0.0.1", "Content-Type": "application/json", "Content-Length": str(len(data))}
    fields.update(headers or {})
    head = "".join(f"{k}: {v}\r\n" for k, v in fields.items() if v is not None)
    return f"POST {path} HTTP/1.1\r\n{head}\r\n".encode("latin-1") + data


def read_answer(sock: socket.socket) -> Answer:
    """One HTTP answer; ConnectionError when the server closed the connection without one."""
    f = sock.makefile("rb")
    status = 100
    while 100 <= status < 200:  # an interim answer (100 Continue) comes before the answer
        line = f.readline()
        if not line:
            raise ConnectionError("the connection was closed without an answer")
        status = int(line.split()[1])
        headers = {}
        while (field := f.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = field.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
    data = f.read(int(headers["content-length"]))
    return Answer(status, headers, json.loads(data))


def exchange(server: SandboxServer, data: bytes, half_close: bool = False, timeout: float = 30.0) -> Answer:
    """Send ``data`` (then, with ``half_close``, end the sending side) and read the answer."""
    with connect(server, timeout) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        return read_answer(sock)


def post(server: SandboxServer, body: Any, headers: dict[str, str] | None = None) -> Answer:
    return exchange(server, request_bytes(body, headers))
