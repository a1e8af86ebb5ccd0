"""The OpenAI wire format: request parsing and validation, response and SSE chunk building, errors.

Only the standard library and posttrain are used. Everything a request can get wrong is a :class:`ProtocolError`
whose status and message the server sends as OpenAI's ``{"error": {"message", "type", "param", "code"}}``;
the message names the offending field (``messages[2].tool_call_id``).

What is accepted and how it is read:

- Chat: ``messages`` (system/developer/user/assistant/tool; content a string, a list of text parts, or null for an
  assistant message with ``tool_calls``), ``tools`` (function tools), ``tool_choice``, ``temperature`` (0 means
  greedy), ``top_p``, ``top_k``, ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``n`` (1 only),
  ``logprobs`` / ``top_logprobs``, ``stream``, ``stream_options.include_usage``, ``seed``.
- Completions: ``prompt`` (a string or token ids, a batch of one), the sampling fields above, ``logprobs``
  (0-5); ``echo=true`` with ``max_tokens=0`` scores the prompt instead of sampling (each prompt token's log-prob
  given those before it, at the request's temperature: :mod:`posttrain.gateway.prompt_scores`).
- Fields OpenAI clients send that change nothing here are accepted and ignored (counted): see :data:`IGNORED`;
  ``presence_penalty`` / ``frequency_penalty`` only at 0, ``logit_bias`` only empty, ``response_format`` only
  ``{"type": "text"}``. Any other field is refused (400 naming it): an option silently not honoured is a wrong sample.
- ``tool_choice``: "none" leaves ``<tool_call>`` blocks in the content (nothing is parsed); "required" and a
  named tool are validated (a named tool must be declared) but do not constrain sampling: the model's text
  decides whether a call is made.
- Answers (which ``<tool_call>`` blocks become calls, log-probs, the ``prompt_token_ids`` / ``token_ids``
  extension fields): :mod:`posttrain.gateway.responses`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "parallel_tool_calls",
        "service_tier",
        "reasoning_effort",
        "modalities",
        "prompt_cache_key",
        "safety_identifier",
        "verbosity",
        "return_token_ids",
    }
)
_ZERO_ONLY = ("presence_penalty", "frequency_penalty")
_SAMPLING = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "n",
    "logprobs",
    "stream",
    "stream_options",
    "seed",
)
CHAT_FIELDS = frozenset({"messages", "tools", "tool_choice", "top_logprobs", "logit_bias", "response_format"})
CHAT_FIELDS = CHAT_FIELDS | set(_SAMPLING) | set(_ZERO_ONLY) | IGNORED
COMPLETION_FIELDS = frozenset({"prompt", "echo", "suffix", "best_of", "logit_bias"}) | set(_SAMPLING)
COMPLETION_FIELDS = COMPLETION_FIELDS | set(_ZERO_ONLY) | IGNORED
MAX_STOPS = 16


class ProtocolError(Exception):
    """A request the server refuses: HTTP ``status``, a message naming what is wrong, the field (``param``)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def bad(param: str, message: str, code: str | None = None) -> ProtocolError:
    """A 400 about ``param``."""
    return ProtocolError(400, f"{param}: {message}", param=param, code=code)


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


def error_body(err: ProtocolError) -> dict[str, Any]:
    """OpenAI's error object for ``err``."""
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "server_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


@dataclass
class Sampling:
    """The sampling-related fields of a request (None: not given)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False


@dataclass
class ChatRequest:
    """A validated chat request. ``messages``: as received; ``template_messages``: as the chat template reads
    them; ``ignored``: the accepted fields that change nothing."""

    messages: list[dict[str, Any]]
    template_messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_names: list[str]
    tool_choice: Any
    sampling: Sampling
    model: str | None
    ignored: list[str]


@dataclass
class CompletionRequest:
    """A validated completion request: ``prompt`` is a string or a list of token ids."""

    prompt: str | list[int]
    sampling: Sampling
    model: str | None
    ignored: list[str]
    logprobs_count: int | None = None
    echo: bool = False  # score the prompt (its tokens' log-probs), generate nothing: max_tokens is 0


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_fields(body: Any, known: frozenset) -> list[str]:
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object")
    for key in body:
        if key not in known:
            raise bad(key, "unknown field; this server does not support it (remove it)")
    ignored = [k for k in body if k in IGNORED]
    for key in _ZERO_ONLY:
        if body.get(key) not in (None, 0, 0.0):
            raise bad(key, f"{body[key]!r} is not supported: only 0 (sampling is the policy's own)")
        if key in body:
            ignored.append(key)
    if body.get("logit_bias") not in (None, {}):
        raise bad("logit_bias", "is not supported (only an empty object)")
    if "logit_bias" in body:
        ignored.append("logit_bias")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad("response_format", f'{fmt!r} is not supported; only {{"type": "text"}}')
    if "response_format" in body:
        ignored.append("response_format")
    return ignored


def _parse_sampling(body: dict[str, Any], min_tokens: int = 1) -> Sampling:
    s = Sampling()
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"must be a string, got {type(model).__name__}")
    t = body.get("temperature")
    if t is not None and (not _is_num(t) or not 0 <= t <= 2):
        raise bad("temperature", f"{t!r} must be a number in [0, 2]")
    s.temperature = t
    p = body.get("top_p")
    if p is not None and (not _is_num(p) or not 0 < p <= 1):
        raise bad("top_p", f"{p!r} must be a number in (0, 1]")
    s.top_p = p
    k = body.get("top_k")
    if k is not None and (not _is_int(k) or (k < 1 and k not in (-1, 0))):
        raise bad("top_k", f"{k!r} must be an integer >= 1, or -1 / 0 for no top-k")
    s.top_k = None if k is None else (-1 if k == 0 else k)
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (not _is_int(v) or v < min_tokens):
            raise bad(key, f"{v!r} must be an integer >= {min_tokens}")
    given = [body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
    s.max_tokens = min(given) if given else None
    s.stop = _parse_stop(body.get("stop"))
    n = body.get("n")
    if n is not None and n != 1:
        raise bad("n", f"{n!r}: only n=1 is supported (make n separate calls)")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad("seed", f"{seed!r} must be an integer")
    s.seed = seed
    s.stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "include_obfuscation"}:
            raise bad("stream_options", 'must be an object with "include_usage" only')
        s.include_usage = _bool(opts, "include_usage", "stream_options.include_usage")
    return s


def _bool(body: dict[str, Any], key: str, name: str | None = None) -> bool:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise bad(name or key, f"{v!r} must be true or false")
    return bool(v)


def _parse_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
        raise bad("stop", "must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"{len(stops)} stop strings; at most {MAX_STOPS}")
    return list(stops)


def _text(content: Any, where: str, allow_none: bool) -> str | None:
    """A message's content as one string (text parts joined by newlines)."""
    if content is None:
        if allow_none:
            return None
        raise bad(where, "is missing or null; give a string or a list of text parts")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, f"must be a string or a list of text parts, got {type(content).__name__}")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad(f"{where}[{j}]", f"only text parts are supported, got {kind!r}")
        parts.append(part["text"])
    return "\n".join(parts)


def _parse_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls as the chat template reads them (arguments as an object)."""
    if not isinstance(calls, list):
        raise bad(where, "must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{where}[{j}].function", 'must be {"name": <string>, "arguments": <JSON string>}')
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                raise bad(f"{where}[{j}].function.arguments", f"is not valid JSON ({exc.msg})") from None
        if not isinstance(args, dict):
            raise bad(f"{where}[{j}].function.arguments", "must encode a JSON object")
        out.append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as the chat template reads them: role and content strings, tool calls with object
    arguments; "developer" becomes "system". Raises ProtocolError naming the bad field."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "must be an object with a role and content")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role", f"{role!r} is not one of {list(ROLES)}")
        calls = m.get("tool_calls") if role == "assistant" else None
        content = _text(m.get("content"), f"{where}.content", allow_none=role == "assistant")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content or ""}
        if calls:
            msg["tool_calls"] = _parse_calls(calls, f"{where}.tool_calls")
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise bad(f"{where}.tool_call_id", "is missing; a tool message answers a tool call by its id")
        out.append(msg)
    return out


def _parse_tools(tools: Any) -> tuple[list[dict[str, Any]] | None, list[str]]:
    if tools is None or tools == []:
        return None, []
    if not isinstance(tools, list):
        raise bad("tools", "must be a list of function tools")
    names = []
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad(f"tools[{j}]", 'must be {"type": "function", "function": {"name": ...}}')
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{j}].function.name", "must be a non-empty string")
        names.append(fn["name"])
    return tools, names


def _parse_tool_choice(choice: Any, names: list[str]) -> Any:
    if choice is None:
        return "auto" if names else "none"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not names:
            raise bad("tool_choice", '"required" needs a non-empty "tools" list')
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(
            "tool_choice", 'must be "auto", "none", "required" or {"type": "function", "function": ...}'
        )
    if fn["name"] not in names:
        raise bad("tool_choice", f"names the tool {fn['name']!r}, which is not in tools ({names})")
    return choice


def parse_chat(body: Any) -> ChatRequest:
    """A chat completion request, validated."""
    ignored = _check_fields(body, CHAT_FIELDS)
    sampling = _parse_sampling(body)
    sampling.logprobs = _bool(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= 20):
        raise bad("top_logprobs", f"{top!r} must be an integer in [0, 20]")
    if top and not sampling.logprobs:
        raise bad("top_logprobs", "needs logprobs=true")
    sampling.top_logprobs = top or 0
    tools, names = _parse_tools(body.get("tools"))
    return ChatRequest(
        messages=body.get("messages"),
        template_messages=parse_messages(body.get("messages")),
        tools=tools,
        tool_names=names,
        tool_choice=_parse_tool_choice(body.get("tool_choice"), names),
        sampling=sampling,
        model=body.get("model"),
        ignored=ignored,
    )


def parse_completion(body: Any) -> CompletionRequest:
    """A (legacy) completion request, validated: one prompt, a string or a list of token ids."""
    ignored = _check_fields(body, COMPLETION_FIELDS)
    echo = _bool(body, "echo")
    sampling = _parse_sampling(body, min_tokens=0 if echo else 1)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ok = (isinstance(prompt, str) and prompt) or (
        isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt)
    )
    if not ok:
        raise bad("prompt", "must be one non-empty string or one non-empty list of token ids")
    if echo and sampling.max_tokens != 0:
        raise bad(
            "max_tokens",
            f"{sampling.max_tokens!r}: echo=true scores the prompt and generates nothing here; send max_tokens=0",
        )
    if echo and sampling.stream:
        raise bad("stream", "echo=true answers in one response; send stream=false")
    if body.get("suffix"):
        raise bad("suffix", "is not supported")
    if body.get("best_of") not in (None, 1):
        raise bad("best_of", "only 1 is supported")
    count = body.get("logprobs")
    if count is not None and (not _is_int(count) or not 0 <= count <= 5):
        raise bad("logprobs", f"{count!r} must be an integer in [0, 5]")
    sampling.logprobs = count is not None
    return CompletionRequest(prompt, sampling, body.get("model"), ignored, count, echo)


def message_key(m: dict[str, Any]) -> tuple:
    """A template message reduced to what decides its tokens: role, content, tool calls (name, arguments)."""
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
        for c in m.get("tool_calls") or ()
    )
    return (m["role"], m.get("content") or "", calls)


def returned_message(content: str | None, calls: list[dict]) -> dict[str, Any]:
    """The assistant message the server returned, in template form (for :func:`message_key`)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        msg["tool_calls"] = _parse_calls(calls, "tool_calls")
    return msg
