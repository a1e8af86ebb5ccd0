"""verifiers: a ToolEnv with one tool, rolled out through its own OpenAI chat-completions client and scored by
its own rubric; the rubric's score is the harness's reward."""

import verifiers as vf
from datasets import Dataset
from openai import AsyncOpenAI
from verifiers.clients import OpenAIChatCompletionsClient

from tests.gateway.clients.tools import add, reward_of


def add_numbers(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return add(a, b)


def correct(completion, answer, **kwargs) -> float:
    """The rubric's one rule: the last assistant message holds the answer."""
    last = [m for m in completion if m["role"] == "assistant"][-1:]
    return reward_of(str(last[0].get("content") or "") if last else "", {"ground_truth": answer})


def environment(row: dict) -> vf.ToolEnv:
    dataset = Dataset.from_list([{"question": row["prompt"], "answer": str(row["ground_truth"])}])
    return vf.ToolEnv(dataset=dataset, tools=[add_numbers], max_turns=3, rubric=vf.Rubric(funcs=[correct]))


async def run(row: dict, base_url: str, api_key: str) -> dict:
    env = environment(row)
    client = OpenAIChatCompletionsClient(AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0))
    rollout_input = {"prompt": env.dataset[0]["prompt"], "answer": env.dataset[0]["answer"], "example_id": 0}
    out = await env.run_rollout(rollout_input, client, "policy", {"max_tokens": 96})
    if out.get("error"):
        raise RuntimeError(f"the verifiers rollout failed: {out['error']}")
    tool_calls = sum(len(m.get("tool_calls") or []) for m in out["completion"] if m["role"] == "assistant")
    return {"reward": out["reward"], "metrics": {"tool_calls": tool_calls}}
