"""The gateway's answers: the sampled text cut at stop strings and split into tool calls, the ``chat.completion``
and ``text_completion`` objects, their server-sent-event chunks, the models list.

Tool calls are read from the text with :func:`posttrain.agents.hermes.parse_tool_calls` (hermes / Qwen style).
A block becomes a call only if it parses and names a declared tool; any other block stays in the content
verbatim, so no call is ever invented and no text is lost. ``content`` is the text outside the calls, stripped,
None when empty (as vLLM's hermes parser does). Log-probs: the sampled tokens' log-probs; each ``top_logprobs``
list holds only the sampled token (the engine reports no alternatives). Extension fields (vLLM's names):
``prompt_token_ids`` (chat: top level; completions: on the choice) and ``token_ids`` on the choice: the exact ids
the engine was given and sampled.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from posttrain.agents.hermes import parse_tool_calls
from posttrain.gateway.protocol import CompletionRequest, Sampling

_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)


def apply_stop(tokenizer: Any, ids: list[int], stops: list[str]) -> tuple[list[int], str, bool]:
    """``ids`` cut after the first token whose decoded text completes a stop string, the text before that stop
    string, and whether one was found (else the ids and their whole text)."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not stops or not any(s in text for s in stops):
        return ids, text, False
    for k in range(1, len(ids) + 1):  # the shortest prefix whose text holds a stop string
        prefix = tokenizer.decode(ids[:k], skip_special_tokens=True)
        hits = [prefix.find(s) for s in stops if s in prefix]
        if hits:
            return ids[:k], prefix[: min(hits)], True
    return ids, text, False  # unreachable: the whole text holds one


def split_tool_calls(text: str, tool_names: list[str], tool_choice: Any) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an assistant text; see the module docstring for which blocks become calls."""
    if tool_choice == "none" or not tool_names:
        return text.strip() or None, []
    calls, kept, last = [], [], 0
    for match in _BLOCK.finditer(text):
        parsed = parse_tool_calls(match.group(0))
        call = parsed[0] if parsed else None
        if call is None or call.error is not None or call.name not in tool_names:
            continue  # stays in the content
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
        )
    kept.append(text[last:])
    return "".join(kept).strip() or None, calls


def _token_logprobs(tokenizer: Any, ids: list[int], logprobs: list[float], top: int) -> dict[str, Any]:
    content = []
    for t, lp in zip(ids, logprobs):
        token = tokenizer.decode([t])
        entry = {"token": token, "logprob": lp, "bytes": list(token.encode())}
        entry["top_logprobs"] = [dict(entry)] if top else []
        content.append(entry)
    return {"content": content}


@dataclass
class Completion:
    """What the server sampled for one request, ready to be written out."""

    model: str
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # OpenAI's: "stop", "length" or "tool_calls"
    content: str | None = None
    tool_calls: list[dict] = field(default_factory=list)
    # echo=true: ``ids`` are the prompt's (nothing generated) and each position's top log-probs by token text
    top_logprobs: list[dict[str, float] | None] | None = None
    id: str = field(default_factory=lambda: f"chatcmpl-{secrets.token_hex(12)}")
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self) -> dict[str, int]:
        p, c = len(self.prompt_ids), 0 if self.top_logprobs is not None else len(self.ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def chat_response(c: Completion, tokenizer: Any, sampling: Sampling) -> dict[str, Any]:
    """The ``chat.completion`` object, with ``prompt_token_ids`` and the choice's ``token_ids``."""
    message: dict[str, Any] = {"role": "assistant", "content": c.content}
    if c.tool_calls:
        message["tool_calls"] = c.tool_calls
    choice = {
        "index": 0,
        "message": message,
        "logprobs": _token_logprobs(tokenizer, c.ids, c.logprobs, sampling.top_logprobs)
        if sampling.logprobs
        else None,
        "finish_reason": c.finish_reason,
        "token_ids": c.ids,
    }
    return {
        "id": c.id,
        "object": "chat.completion",
        "created": c.created,
        "model": c.model,
        "choices": [choice],
        "usage": c.usage(),
        "prompt_token_ids": c.prompt_ids,
    }


def chat_chunks(c: Completion, tokenizer: Any, sampling: Sampling) -> list[dict[str, Any]]:
    """The SSE chunks of a streamed chat completion (made after generation has finished): role, content,
    tool calls, the final chunk with the finish reason, and the usage chunk when asked for."""
    head = {"id": c.id, "object": "chat.completion.chunk", "created": c.created, "model": c.model}

    def chunk(delta: dict, finish: str | None = None, **extra: Any) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}
        return {**head, "choices": [choice]}

    out = [{**chunk({"role": "assistant", "content": ""}), "prompt_token_ids": c.prompt_ids}]
    logprobs = (
        _token_logprobs(tokenizer, c.ids, c.logprobs, sampling.top_logprobs) if sampling.logprobs else None
    )
    out.append(chunk({"content": c.content or ""}, token_ids=c.ids))
    out[-1]["choices"][0]["logprobs"] = logprobs
    if c.tool_calls:
        calls = [{"index": i, **call} for i, call in enumerate(c.tool_calls)]
        out.append(chunk({"tool_calls": calls}))
    out.append(chunk({}, c.finish_reason))
    if sampling.include_usage:
        out.append({**head, "choices": [], "usage": c.usage()})
    return out


def completion_response(c: Completion, tokenizer: Any, count: int | None) -> dict[str, Any]:
    """The ``text_completion`` object, with the choice's ``prompt_token_ids`` and ``token_ids``."""
    logprobs = None
    if count is not None:
        tokens = [tokenizer.decode([t]) for t in c.ids]
        offsets, at = [], 0
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        tops = [{tok: lp} for tok, lp in zip(tokens, c.logprobs)] if count else None
        if c.top_logprobs is not None and count:
            tops = c.top_logprobs
        logprobs = {
            "tokens": tokens,
            "token_logprobs": c.logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
    choice = {
        "index": 0,
        "text": c.text,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
        "prompt_token_ids": c.prompt_ids,
        "token_ids": c.ids,
    }
    cid = c.id.replace("chatcmpl-", "cmpl-")
    return {
        "id": cid,
        "object": "text_completion",
        "created": c.created,
        "model": c.model,
        "choices": [choice],
        "usage": c.usage(),
    }


def completion_chunks(c: Completion, tokenizer: Any, req: CompletionRequest) -> list[dict[str, Any]]:
    """A streamed completion: one chunk with the text, one with the finish reason, the usage when asked for."""
    whole = completion_response(c, tokenizer, req.logprobs_count)
    first = {**whole, "choices": [{**whole["choices"][0], "finish_reason": None}]}
    first.pop("usage")
    last = {
        **first,
        "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": c.finish_reason}],
    }
    out = [first, last]
    if req.sampling.include_usage:
        out.append(
            {**{k: first[k] for k in ("id", "object", "created", "model")}, "choices": [], "usage": c.usage()}
        )
    return out


def sse(chunks: list[dict[str, Any]]) -> bytes:
    """Server-sent events: one ``data:`` line per chunk, then ``data: [DONE]``."""
    return b"".join(f"data: {json.dumps(x)}\n\n".encode() for x in chunks) + b"data: [DONE]\n\n"


def models_response(model: str, created: int) -> dict[str, Any]:
    """``GET /v1/models``: the one served model."""
    entry = {"id": model, "object": "model", "created": created, "owned_by": "posttrain"}
    return {"object": "list", "data": [entry]}
