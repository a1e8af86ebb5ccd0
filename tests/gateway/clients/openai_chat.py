"""The `openai` client: a tool-calling loop, the first call plain, the follow-up streamed."""

import json

import openai

from tests.gateway.clients.tools import ADD_TOOL, add, reward_of


def _streamed(client: openai.OpenAI, messages: list) -> str:
    """The follow-up call, streamed: the text is the chunks' deltas joined."""
    stream = client.chat.completions.create(
        model="policy", messages=messages, tools=[ADD_TOOL], max_tokens=96, stream=True
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def run(row: dict, base_url: str, api_key: str) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    reply = client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL], max_tokens=96)
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    tool_calls = message.tool_calls or []
    for call in tool_calls:
        result = add(**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    if not tool_calls:
        messages.append({"role": "user", "content": "Go on."})
    answer = _streamed(client, messages)
    return {"reward": reward_of(answer, row), "metrics": {"tool_calls": len(tool_calls)}}
