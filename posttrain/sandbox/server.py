"""`posttrain sandbox serve`: the local sandbox behind SandboxFusion's `POST /run_code` API, so that code can run
on separate CPU hosts (and so the client is tested against a real server)."""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from posttrain.config.errors import ConfigError
from posttrain.sandbox.build import Sandbox
from posttrain.sandbox.wire import request_from_json, response_to_json

logger = logging.getLogger("posttrain.sandbox")
MAX_BODY_BYTES = 64 * 1024 * 1024


class SandboxServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], sandbox: Sandbox) -> None:
        super().__init__(address, _Handler)
        self.sandbox = sandbox

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: SandboxServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        logger.debug(format, *args)

    def _answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.rstrip("/") in ("", "/health", "/v1/ping"):
            self._answer(200, {"status": "ok", "sandbox": self.server.sandbox.describe()})
        else:
            self._answer(404, {"status": "SandboxError", "message": f"no such path {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") not in ("/run_code", "/v1/run_code"):
            self._answer(404, {"status": "SandboxError", "message": f"no such path {self.path}"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self._answer(413, {"status": "SandboxError", "message": f"body over {MAX_BODY_BYTES} bytes"})
            return
        try:
            request = request_from_json(json.loads(self.rfile.read(length) or b"null"))
        except (ValueError, ConfigError) as exc:  # JSONDecodeError is a ValueError
            self._answer(400, {"status": "SandboxError", "message": str(exc)})
            return
        try:
            result = self.server.sandbox.run(request)
        except ConfigError as exc:  # e.g. a file name leaving the sandbox's directory
            self._answer(400, {"status": "SandboxError", "message": str(exc)})
            return
        self._answer(200, response_to_json(result))


def serve(sandbox: Sandbox, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Serve until interrupted."""
    server = SandboxServer((host, port), sandbox)
    print(f"posttrain sandbox: serving POST {server.url}/run_code ({sandbox.describe()})", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        sandbox.close()
