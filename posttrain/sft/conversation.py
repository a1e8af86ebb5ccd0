"""SFT on whole conversations: multi-turn messages with tool calls, tool results and user replies.

A record whose prompt is a list of messages holding assistant messages is a conversation example (rows
``{"messages": [...]}`` read with ``data.prompt_key=messages sft.response_key=''``; a row's ``tools`` field, the
OpenAI function schemas, is rendered by the chat template as a rollout renders it). The prompt is everything before
the first assistant message with the assistant header; the response is the rest. Only the assistant messages are
trained on, each with its end-of-turn token; tool results, user replies, the template's separators and the next
assistant headers are context (mask 0).

The parts are rendered as the multi-turn rollout renders them: the conversation up to each message through the chat
template, each new part the text the longer rendering appends (checked: a template that rewrites earlier turns is
a DataError), tokenized on its own. The assistant's part is its text and the end-of-turn token, which is what the
model samples; what follows that token is the environment's.
"""

from __future__ import annotations

from typing import Any

from posttrain.config.errors import DataError

Messages = list[dict[str, Any]]


def is_conversation(prompt: Any) -> bool:
    """A list of messages with at least one assistant message after the first message."""
    return isinstance(prompt, list) and any(m.get("role") == "assistant" for m in prompt[1:])


def _render(tokenizer, messages: Messages, tools, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def conversation_parts(
    messages: Messages, tokenizer, tools=None, where: str = "conversation"
) -> list[tuple[str, bool]]:
    """``[(text, trained)]``: the prompt (not trained), then each assistant message's text with its end-of-turn
    token (trained) and the environment's text between them (not trained). A trailing non-assistant part is
    dropped: nothing after it is trained on."""
    eos = tokenizer.eos_token
    first = next(i for i, m in enumerate(messages) if m.get("role") == "assistant" and i > 0)
    done = _render(tokenizer, messages[:first], tools, True)
    parts: list[tuple[str, bool]] = [(done, False)]
    i = first
    while i < len(messages):
        if messages[i].get("role") == "assistant":
            end, generation_prompt = i + 1, False
        else:  # the run of environment messages up to the next assistant message, with its header
            end = next(
                (j for j in range(i, len(messages)) if messages[j].get("role") == "assistant"), len(messages)
            )
            generation_prompt = True
            if end == len(messages):
                break
        text = _render(tokenizer, messages[:end], tools, generation_prompt)
        if not text.startswith(done):
            raise DataError(
                f"{where}: the chat template renders messages 0..{i - 1} differently once message {i} follows; "
                "conversation SFT (and multi-turn rollouts) need a template whose rendering only appends"
            )
        new = text[len(done) :]
        if generation_prompt:
            parts.append((new, False))
        else:
            cut = new.find(eos)
            if cut < 0:
                raise DataError(f"{where}: the chat template does not end assistant message {i} with {eos!r}")
            parts.append((new[: cut + len(eos)], True))
            parts.append((new[cut + len(eos) :], False))
        done, i = text, end
    return parts


def conversation_example(
    messages: Messages, tokenizer, tools=None, where: str = "conversation"
) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, response ids, response mask): the mask is 1 on the assistant messages' tokens only."""
    parts = conversation_parts(messages, tokenizer, tools, where)
    prompt = _ids(tokenizer, parts[0][0])
    response: list[int] = []
    mask: list[int] = []
    for text, trained in parts[1:]:
        ids = _ids(tokenizer, text)
        response += ids
        mask += [int(trained)] * len(ids)
    while mask and not mask[-1]:  # the separator after the last assistant message is not part of the example
        response.pop()
        mask.pop()
    return prompt, response, mask
