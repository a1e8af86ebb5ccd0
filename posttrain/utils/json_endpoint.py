"""JSON POSTs to an HTTP endpoint with the standard library only: a timeout per try, retries with exponential
backoff, and counts of requests, retries and failed calls (shared by the LLM judge and the remote distillation
teacher).

A try fails when it cannot connect, times out, gets an HTTP error status, or its body is refused by the caller's
``read`` (which raises :class:`CallFailed` naming what is wrong). A failed try is tried again ``max_retries``
times, waiting ``backoff_s * 2**attempt`` seconds before each retry; a call whose tries all fail raises
:class:`CallFailed` with the last error and counts one failure.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class CallFailed(Exception):
    """One try, or (raised by :meth:`JsonEndpoint.call`) one call after all its tries, failed."""


class JsonEndpoint:
    """One URL taking JSON bodies, safe to call from several threads at once."""

    def __init__(
        self,
        url: str,
        api_key: str = "",
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
    ) -> None:
        self.url = url
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.requests = 0  # tries sent, in the run
        self.retries = 0  # failed tries that were tried again, in the run
        self.failures = 0  # calls whose tries all failed, in the run
        self._lock = threading.Lock()

    def call(self, body: dict[str, Any], read: Callable[[bytes], T]) -> T:
        """``read`` of the reply to ``body``; CallFailed with the last try's error once all tries failed."""
        error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                with self._lock:
                    self.retries += 1
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return read(self.post(body))
            except CallFailed as exc:
                error = str(exc)
        with self._lock:
            self.failures += 1
        raise CallFailed(error)

    def post(self, body: dict[str, Any]) -> bytes:
        """One try: the reply's body, or CallFailed (refused, unreachable, timed out, reset, an HTTP error)."""
        with self._lock:
            self.requests += 1
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return reply.read()
        except urllib.error.HTTPError as exc:
            raise CallFailed(f"HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:  # refused, unreachable, timed out, reset
            reason = getattr(exc, "reason", exc)
            raise CallFailed(f"{type(exc).__name__}: {reason}") from None
