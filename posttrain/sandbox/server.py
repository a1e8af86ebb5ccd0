"""`posttrain sandbox serve`: the local sandbox behind SandboxFusion's `POST /run_code` API, so that code can run
on separate CPU hosts (and so the client is tested against a real server).

What a client cannot do to it: hold a thread with a request that never completes (each request must arrive in
full within ``request_timeout_s``; an idle connection is closed after as long), open threads without bound (at
most ``max_connections`` are served, the next ones get 503), send a body or files over the caps (413/422), or
keep a run going after it hung up (the run is cancelled). Every refusal is a JSON answer; without a token the
server is meant for loopback only (see :func:`check_exposure`)."""

from __future__ import annotations

import argparse
import contextlib
import hmac
import io
import ipaddress
import json
import logging
import re
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from posttrain.config.errors import ConfigError
from posttrain.sandbox.build import Sandbox
from posttrain.sandbox.types import RunRequest, RunResult
from posttrain.sandbox.wire import RequestError, request_from_json, response_to_json

logger = logging.getLogger("posttrain.sandbox")
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_CONNECTIONS = 64
REQUEST_TIMEOUT_S = 30.0
MIN_TOKEN_CHARS = 16
_LINGER_S = 1.0  # after our answer, read what the client still sends: closing on unread data resets the
_LINGER_BYTES = 1024 * 1024  # connection, and the client may lose our answer
_WATCH_S = 0.1  # how often a run's watcher looks for its client's hang-up


class SandboxServer(ThreadingHTTPServer):
    """The HTTP server; ``token``: the bearer token every request must carry (None: no authentication)."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        sandbox: Sandbox,
        token: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        super().__init__(address, _Handler)
        self.sandbox = sandbox
        self.token = token
        self.request_timeout_s = request_timeout_s
        self.max_connections = max_connections
        self._serving = threading.BoundedSemaphore(max_connections)
        self._refusing = threading.BoundedSemaphore(max_connections)  # threads that only answer 503

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def process_request(self, request: socket.socket, client_address: tuple) -> None:
        """A thread per connection, at most ``max_connections``; beyond them a short-lived thread answers 503;
        beyond those too (a flood), the connection is closed unanswered."""
        if self._serving.acquire(blocking=False):
            work, slots = self.finish_request, self._serving
        elif self._refusing.acquire(blocking=False):
            work, slots = self._refuse, self._refusing
        else:
            self.close_request(request)
            return
        thread = threading.Thread(
            target=self._thread, args=(work, slots, request, client_address), daemon=True
        )
        thread.start()

    def _thread(
        self, work: Callable, slots: threading.BoundedSemaphore, request: socket.socket, addr: tuple
    ) -> None:
        try:
            work(request, addr)
        except Exception:
            self.handle_error(request, addr)
        finally:
            self.shutdown_request(request)
            slots.release()

    def _refuse(self, sock: socket.socket, _addr: tuple) -> None:
        message = f"{self.max_connections} connections at once already; retry later"
        body = json.dumps(_error_body(message)).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        with contextlib.suppress(OSError):  # a refused client that is already gone
            sock.settimeout(_LINGER_S)
            sock.sendall(head.encode() + body)

    def handle_error(self, request: socket.socket, client_address: tuple) -> None:
        logger.exception("posttrain sandbox server: error on a connection from %s", client_address)

    def shutdown_request(self, request: socket.socket) -> None:
        with contextlib.suppress(OSError):  # the client is gone already
            request.shutdown(socket.SHUT_WR)
        _drain(request)
        self.close_request(request)


def _drain(sock: socket.socket) -> None:
    deadline, left = time.monotonic() + _LINGER_S, _LINGER_BYTES
    try:
        while left > 0 and (wait := deadline - time.monotonic()) > 0:
            sock.settimeout(wait)
            data = sock.recv(65536)
            if not data:
                return
            left -= len(data)
    except OSError:
        return


def _error_body(message: str, detail: object = None) -> dict:
    """SandboxFusion's failure shape (status, message) plus FastAPI's ``detail``, so either kind of client
    finds what it reads."""
    return {"status": "SandboxError", "message": message, "detail": message if detail is None else detail}


class _DeadlineReader(io.RawIOBase):
    """The connection's reads, each bounded by what is left of the request's deadline: a request that
    trickles in a byte at a time ends at the deadline as one that sends nothing."""

    def __init__(self, handler: _Handler) -> None:
        self.handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:
        h = self.handler
        left = h.deadline - time.monotonic()
        if left <= 0:
            h.timed_out = True
            raise TimeoutError("the request did not arrive in time")
        h.connection.settimeout(left)
        try:
            n = h.connection.recv_into(buffer)
        except TimeoutError:
            h.timed_out = True
            raise
        h.got_bytes = h.got_bytes or n > 0
        return n


class _Handler(BaseHTTPRequestHandler):
    server: SandboxServer
    protocol_version = "HTTP/1.1"
    # Headers and body leave in two writes: with Nagle's algorithm the body would wait for the client's delayed
    # ACK of the headers (up to 40 ms an answer; the gateway measured it, docs/results/gateway.md).
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # else the socket's file descriptor outlives close() (makefile holds a reference)
        self.rfile = io.BufferedReader(_DeadlineReader(self))

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        logger.debug(format, *args)

    def handle_one_request(self) -> None:
        """One request, whatever happens: an answer (408 for one cut off by the deadline, 500 for a bug here,
        with its traceback logged), or a closed connection when the client is gone."""
        self.deadline = time.monotonic() + self.server.request_timeout_s
        self.got_bytes = self.timed_out = self.answered = False
        self.requestline, self.command, self.request_version = "", "", "HTTP/1.0"  # if cut off before parsing
        try:
            super().handle_one_request()  # answers a timeout by closing the connection
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away: nobody to answer
        except Exception:
            logger.exception("posttrain sandbox server: error answering %r", self.requestline)
            self._answer(500, _error_body("internal error of the sandbox server (logged on the server)"))
        if self.timed_out and self.got_bytes:
            limit = self.server.request_timeout_s
            self._answer(408, _error_body(f"the request did not arrive in full within {limit:g} s"))

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (malformed request line, headers too long, unknown method) as JSON."""
        self._answer(code, _error_body(message or self.responses.get(code, ("error",))[0]))

    def _answer(self, code: int, body: dict, headers: tuple[tuple[str, str], ...] = ()) -> None:
        """Send one answer, once; any answer but 200 closes the connection (its body may be unread)."""
        if self.answered:
            return
        self.answered = True
        if self.request_version == "HTTP/0.9":  # a garbled request line: answer with a status line anyway
            self.request_version = "HTTP/1.0"
        data = json.dumps(body).encode()
        try:
            self.connection.settimeout(self.server.request_timeout_s)  # a client that never reads our answer
            self.send_response(code)
            for name, value in (("Content-Type", "application/json"), *headers):
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            if code != 200:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client went away, or stopped reading
            self.close_connection = True

    def _authorized(self) -> bool:
        token = self.server.token
        if token is None:
            return True
        sent = str(self.headers.get("Authorization", "")).encode("utf-8", "surrogateescape")
        if hmac.compare_digest(sent, f"Bearer {token}".encode()):
            return True
        message = "this server needs the header `Authorization: Bearer <token>` with its token"
        self._answer(401, _error_body(message), (("WWW-Authenticate", "Bearer"),))
        return False

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if not self._authorized():
            return
        if self.path.rstrip("/") in ("", "/health", "/v1/ping"):
            self._answer(200, {"status": "ok", "sandbox": self.server.sandbox.describe()})
        else:
            self._answer(404, _error_body(f"no such path {self.path}"))

    def do_POST(self) -> None:  # noqa: N802
        if not self._authorized():
            return
        if self.path.rstrip("/") not in ("/run_code", "/v1/run_code"):
            self._answer(404, _error_body(f"no such path {self.path}"))
            return
        length = self._content_length()
        if length is None:
            return
        data = self.rfile.read(length)
        if len(data) < length:  # the client ended its side early; it may still read our answer
            self._answer(400, _error_body(f"the body ended after {len(data)} of {length} bytes"))
            return
        try:
            request = request_from_json(json.loads(data))
        except RecursionError:
            self._answer(400, _error_body("the body's JSON is nested too deeply"))
        except RequestError as exc:
            self._answer(422, _error_body(str(exc), exc.detail()))
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too many digits
            self._answer(400, _error_body(f"the body is not JSON: {exc}"))
        else:
            try:
                result = self._run(request)
            except ConfigError as exc:  # what the backend refuses to run (files over the run's /tmp)
                self._answer(
                    422, _error_body(str(exc), [{"type": "value_error", "loc": ["body"], "msg": str(exc)}])
                )
                return
            if result is not None:
                self._answer(200, response_to_json(result))

    def _content_length(self) -> int | None:
        """The body's length from a valid Content-Length, else None after answering 400/411/413."""
        values = self.headers.get_all("Content-Length") or []
        if "Transfer-Encoding" in self.headers or not values:
            self._answer(411, _error_body("send the body with a Content-Length header (no chunked encoding)"))
            return None
        text = str(values[0]).strip()
        if len(values) > 1 or not (text.isascii() and text.isdigit()):
            self._answer(
                400, _error_body(f"Content-Length must be one whole number of bytes, got {values!r}")
            )
            return None
        if int(text) > MAX_BODY_BYTES:
            self._answer(413, _error_body(f"body of {text} bytes; at most {MAX_BODY_BYTES}"))
            return None
        return int(text)

    def _run(self, request: RunRequest) -> RunResult | None:
        """Run ``request``; cancelled (None returned) as soon as the client hangs up."""
        cancel, done = threading.Event(), threading.Event()
        watcher = threading.Thread(target=_watch_hang_up, args=(self.connection, cancel, done), daemon=True)
        watcher.start()
        try:
            result = self.server.sandbox.run(request, cancel=cancel)
        finally:
            done.set()
        if cancel.is_set():
            self.close_connection = True
            return None
        return result


def _watch_hang_up(sock: socket.socket, cancel: threading.Event, done: threading.Event) -> None:
    """Set ``cancel`` when the client closes its connection (end of file) before ``done``. Bytes of a next
    request (pipelining) end the watch: they are the next request's."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    while not done.is_set():
        if not poller.poll(_WATCH_S * 1000) or done.is_set():
            continue
        try:
            data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue
        except OSError:  # reset by the peer
            data = b""
        if not data:
            cancel.set()
        return


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, or "" (every interface)
        return False


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def read_token(path: str) -> str:
    """The token in the file ``path`` (surrounding whitespace dropped); a ConfigError saying how to make one."""
    fix = f"write one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > {path}"
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--token-file {path}: cannot read it ({exc}); {fix}") from None
    if len(token) < MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable() or " " in token:
        raise ConfigError(
            f"--token-file {path}: the token must be at least {MIN_TOKEN_CHARS} printable ASCII characters "
            f"without spaces; {fix}"
        )
    return token


@dataclass(frozen=True)
class ServerSettings:
    """How `posttrain sandbox serve` listens (its command-line flags)."""

    host: str = "127.0.0.1"
    port: int = 8080
    token: str | None = None  # the bearer token every request must send; None: no authentication
    max_connections: int = MAX_CONNECTIONS
    request_timeout_s: float = REQUEST_TIMEOUT_S

    def check(self) -> None:
        """A ConfigError for settings that cannot serve, or that would open the sandbox to the network: without
        a token, anyone who reaches a non-loopback port runs code on this host."""
        if not 0 <= self.port <= 65535:
            raise ConfigError(
                f"--port {self.port}: a TCP port is 0 to 65535 (0: any free port; default 8080)"
            )
        if re.fullmatch(r"[\d.]+", self.host) and not _is_address(self.host):
            raise ConfigError(
                f"--host {self.host!r} is not a valid IPv4 address (four numbers 0 to 255); e.g. --host 127.0.0.1"
            )
        if self.token is None and not is_loopback(self.host):
            raise ConfigError(
                f"--host {self.host!r} is not a loopback address, and without a token anyone who reaches the "
                "port runs code on this host; pass --token-file PATH (a file holding a secret token; clients "
                "set sandbox.sandbox_fusion.token_env), or listen on --host 127.0.0.1"
            )
        if self.max_connections < 1:
            raise ConfigError(
                f"--max-connections {self.max_connections}: at least 1 (default {MAX_CONNECTIONS})"
            )
        if not self.request_timeout_s > 0:
            raise ConfigError(
                f"--request-timeout-s {self.request_timeout_s}: must be positive (default {REQUEST_TIMEOUT_S:g})"
            )


def serve(sandbox: Sandbox, settings: ServerSettings) -> None:
    """Serve until interrupted."""
    settings.check()
    s = settings
    try:
        server = SandboxServer((s.host, s.port), sandbox, s.token, s.max_connections, s.request_timeout_s)
    except OSError as exc:  # the port is taken, the host is not this machine's or does not resolve
        sandbox.close()
        raise ConfigError(
            f"cannot listen on --host {s.host} --port {s.port}: {exc.strerror or exc}; choose a free --port "
            "(another server may hold this one) or an address of this machine"
        ) from None
    auth = "bearer token required" if s.token else "no token: loopback only"
    print(f"posttrain sandbox: serving POST {server.url}/run_code ({sandbox.describe()}; {auth})", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        sandbox.close()


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """`posttrain sandbox serve`'s flags."""
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="Port to listen on (default: 8080)")
    parser.add_argument(
        "--token-file",
        default="",
        help="File holding the bearer token requests must send; required off loopback",
    )
    parser.add_argument(
        "--max-connections", type=int, default=MAX_CONNECTIONS, help="Served at once; beyond: 503"
    )
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=REQUEST_TIMEOUT_S,
        help="For a request to arrive in full; idle limit",
    )


def settings_from_arguments(args: argparse.Namespace) -> ServerSettings:
    """The server's settings from its flags, checked (a ConfigError for a setting that cannot serve, or that would
    open the sandbox to the network)."""
    token = read_token(args.token_file) if args.token_file else None
    settings = ServerSettings(args.host, args.port, token, args.max_connections, args.request_timeout_s)
    settings.check()
    return settings
