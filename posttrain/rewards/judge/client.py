"""Calls to an OpenAI-compatible chat endpoint (``POST {base_url}/chat/completions``), with the standard library
only: a timeout per request, retries with exponential backoff, and a failure budget for the run.

A request fails when it cannot connect, times out, gets an HTTP error status, or gets a body that is not a chat
completion (no ``choices[0].message.content`` string; a null content is an empty answer, read as an unparsed
verdict). A failed request is tried again ``max_retries`` times,
waiting ``backoff_s * 2**attempt`` seconds before each retry; a call whose tries all fail is a failed call.
After more than ``max_failures`` failed calls in the run, :class:`JudgeUnavailable` stops it, naming the
endpoint and the last error.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from posttrain.config.errors import ConfigError


class JudgeUnavailable(ConfigError):
    """The judge endpoint the config names failed more calls than reward.judge.max_failures allows: a clean
    stop with one message (the CLI's exit 2), since training on without the judge's scores would be wrong."""


class JudgeCallFailed(Exception):
    """One call failed after all its tries (the caller counts it and scores the sample)."""


@dataclass(frozen=True)
class Answer:
    """The judge's text and the tokens the endpoint reported for the call (0 when it reports none)."""

    text: str
    tokens: int


class ChatEndpoint:
    """One OpenAI-compatible endpoint, safe to call from several threads at once."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str = "",
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        max_failures: int = 32,
        max_tokens: int = 512,
        temperature: float = 0.0,
    ) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_failures = max_failures
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.failures = 0  # failed calls in the run
        self.retries = 0  # failed tries that were tried again, in the run
        self._lock = threading.Lock()

    def chat(self, messages: list[dict[str, str]]) -> Answer:
        """The judge's answer to ``messages``; raises JudgeCallFailed after the last try, or JudgeUnavailable
        once the run's failed calls exceed the budget."""
        error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                with self._lock:
                    self.retries += 1
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return self._request(messages)
            except JudgeCallFailed as exc:
                error = str(exc)
        with self._lock:
            self.failures += 1
            over = self.failures > self.max_failures
        if over:
            raise JudgeUnavailable(
                f"the judge endpoint {self.url} (reward.judge.base_url, model {self.model!r}) failed "
                f"{self.failures} calls, each after {self.max_retries + 1} tries, which exceeds "
                f"reward.judge.max_failures={self.max_failures}; the last error: {error}. Check that the server "
                "is up and serves that model, or raise reward.judge.timeout_s / reward.judge.max_failures"
            )
        raise JudgeCallFailed(error)

    def _request(self, messages: list[dict[str, str]]) -> Answer:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as exc:
            raise JudgeCallFailed(f"HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:  # refused, unreachable, timed out, reset
            reason = getattr(exc, "reason", exc)
            raise JudgeCallFailed(f"{type(exc).__name__}: {reason}") from None
        return _answer(raw)


def _answer(raw: bytes) -> Answer:
    """The chat completion in ``raw``, or JudgeCallFailed naming what is wrong with it."""
    try:
        data = json.loads(raw)
        text = data["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise JudgeCallFailed(f"the reply is not a chat completion: {raw[:200]!r}") from None
    if text is None:  # a valid completion with no text (e.g. only tool calls): an empty, unreadable verdict
        text = ""
    if not isinstance(text, str):
        raise JudgeCallFailed(f"the reply's message content is {type(text).__name__}, not text")
    usage = data.get("usage") if isinstance(data, dict) else None
    tokens = usage.get("total_tokens", 0) if isinstance(usage, dict) else 0
    return Answer(text, int(tokens) if isinstance(tokens, (int, float)) else 0)
