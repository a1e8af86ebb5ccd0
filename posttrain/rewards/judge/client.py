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
from dataclasses import dataclass

from posttrain.config.errors import ConfigError
from posttrain.utils.json_endpoint import CallFailed, JsonEndpoint


class JudgeUnavailable(ConfigError):
    """The judge endpoint the config names failed more calls than reward.judge.max_failures allows: a clean
    stop with one message (the CLI's exit 2), since training on without the judge's scores would be wrong."""


class JudgeCallFailed(CallFailed):
    """One call failed after all its tries (the caller counts it and scores the sample)."""


@dataclass(frozen=True)
class Answer:
    """The judge's text and the tokens the endpoint reported for the call (0 when it reports none)."""

    text: str
    tokens: int


class ChatEndpoint:
    """One OpenAI-compatible endpoint, safe to call from several threads at once (the HTTP tries, retries and
    their counts are :class:`posttrain.utils.json_endpoint.JsonEndpoint`'s)."""

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
        self.http = JsonEndpoint(
            base_url.rstrip("/") + "/chat/completions", api_key, timeout_s, max_retries, backoff_s
        )
        self.url = self.http.url
        self.model = model
        self.max_retries = max_retries
        self.max_failures = max_failures
        self.max_tokens = max_tokens
        self.temperature = temperature

    @property
    def failures(self) -> int:
        """Failed calls in the run."""
        return self.http.failures

    @property
    def retries(self) -> int:
        """Failed tries that were tried again, in the run."""
        return self.http.retries

    def chat(self, messages: list[dict[str, str]]) -> Answer:
        """The judge's answer to ``messages``; raises JudgeCallFailed after the last try, or JudgeUnavailable
        once the run's failed calls exceed the budget."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        try:
            return self.http.call(body, _answer)
        except CallFailed as exc:
            error = str(exc)
        if self.http.failures > self.max_failures:
            raise JudgeUnavailable(
                f"the judge endpoint {self.url} (reward.judge.base_url, model {self.model!r}) failed "
                f"{self.http.failures} calls, each after {self.max_retries + 1} tries, which exceeds "
                f"reward.judge.max_failures={self.max_failures}; the last error: {error}. Check that the server "
                "is up and serves that model, or raise reward.judge.timeout_s / reward.judge.max_failures"
            )
        raise JudgeCallFailed(error)


def _answer(raw: bytes) -> Answer:
    """The chat completion in ``raw``, or CallFailed naming what is wrong with it (the try is retried)."""
    try:
        data = json.loads(raw)
        text = data["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise CallFailed(f"the reply is not a chat completion: {raw[:200]!r}") from None
    if text is None:  # a valid completion with no text (e.g. only tool calls): an empty, unreadable verdict
        text = ""
    if not isinstance(text, str):
        raise CallFailed(f"the reply's message content is {type(text).__name__}, not text")
    usage = data.get("usage") if isinstance(data, dict) else None
    tokens = usage.get("total_tokens", 0) if isinstance(usage, dict) else 0
    return Answer(text, int(tokens) if isinstance(tokens, (int, float)) else 0)
