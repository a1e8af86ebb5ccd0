"""A client of SandboxFusion's `POST /run_code` (or of `posttrain sandbox serve`, which speaks the same API):
round-robin over several URLs, retries on 5xx answers, timeouts and refused connections."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import urllib.error
import urllib.request

from posttrain.config.errors import ConfigError
from posttrain.sandbox.types import (
    SANDBOX_ERROR,
    Limits,
    RunRequest,
    RunResult,
    unsupported_language,
)
from posttrain.sandbox.wire import request_to_json, response_from_json

_BACKOFF_S = 0.1


def run_code_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(
            f"sandbox.sandbox_fusion.url={url!r} is not an http(s) URL; write e.g. http://10.0.0.5:8080"
        )
    return url if url.endswith("/run_code") else url + "/run_code"


class FusionSandbox:
    """Runs programs on SandboxFusion-compatible services. ``run`` is thread-safe."""

    name = "sandbox_fusion"
    own_pid_namespace = False  # a service's isolation is its own business: assume nothing

    def __init__(
        self,
        urls: list[str],
        limits: Limits | None = None,
        request_timeout_s: float = 30.0,
        max_retries: int = 3,
        token_env: str = "",
    ) -> None:
        if not urls:
            raise ConfigError(
                "sandbox.backend=sandbox_fusion needs sandbox.sandbox_fusion.url (one URL or several, "
                "e.g. sandbox.sandbox_fusion.url=http://host1:8080,http://host2:8080)"
            )
        self.urls = [run_code_url(u) for u in urls]
        self.limits = limits or Limits()
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self._headers = {"Content-Type": "application/json"}
        if token_env:
            self._headers["Authorization"] = f"Bearer {_token(token_env)}"
        self._next = itertools.cycle(range(len(self.urls)))
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"SandboxFusion API at {', '.join(self.urls)} (round-robin, {self.max_retries} retries)"

    def _url(self) -> str:
        with self._lock:
            return self.urls[next(self._next)]

    def run(self, request: RunRequest, cancel: threading.Event | None = None) -> RunResult:
        """``cancel`` (set: no further retries) is accepted so that a server may forward to this backend."""
        if refused := unsupported_language(request):
            return refused
        limits = request.limits(self.limits)
        payload = request_to_json(request)
        payload["run_timeout"] = limits.time_limit_s
        payload["memory_limit_MB"] = limits.memory_limit_mb
        data = json.dumps(payload).encode()
        start = time.monotonic()
        errors = []
        for attempt in range(self.max_retries + 1):
            if cancel is not None and cancel.is_set():
                break
            if attempt:
                time.sleep(_BACKOFF_S * 2 ** (attempt - 1))
            url = self._url()
            try:
                body = self._post(url, data, limits.time_limit_s + self.request_timeout_s)
            except _Retry as exc:
                errors.append(f"{url}: {exc}")
                continue
            except _Fatal as exc:
                return RunResult(SANDBOX_ERROR, None, "", f"{url}: {exc}", time.monotonic() - start)
            return response_from_json(body, time.monotonic() - start)
        message = f"no answer after {self.max_retries + 1} tries: " + "; ".join(errors[-3:])
        return RunResult(SANDBOX_ERROR, None, "", message, time.monotonic() - start)

    def _post(self, url: str, data: bytes, timeout: float) -> object:
        req = urllib.request.Request(url, data=data, headers=self._headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode(errors="replace")
            if exc.code >= 500:
                raise _Retry(f"HTTP {exc.code} {detail}") from None
            raise _Fatal(f"HTTP {exc.code} {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            raise _Retry(repr(getattr(exc, "reason", exc))) from None
        except ValueError as exc:  # not JSON
            raise _Retry(f"malformed answer ({exc})") from None


def _token(name: str) -> str:
    """The bearer token in the environment variable ``name`` (the config names the variable, never the token)."""
    token = os.environ.get(name, "").strip()
    if not token:
        raise ConfigError(
            f"sandbox.sandbox_fusion.token_env={name!r}: the environment variable {name} is not set or empty; "
            f"export {name}=<the token in the server's --token-file>, or set sandbox.sandbox_fusion.token_env='' "
            "for a server without a token"
        )
    if not token.isascii() or not token.isprintable():
        raise ConfigError(
            f"sandbox.sandbox_fusion.token_env={name!r}: the token in {name} must be printable ASCII "
            "(as `posttrain sandbox serve --token-file` requires)"
        )
    return token


class _Retry(Exception):
    """A failure worth another try (5xx, timeout, refused or reset connection)."""


class _Fatal(Exception):
    """A failure another try would repeat (4xx: the request is wrong)."""
