"""The OpenAI Agents SDK: an Agent with a function tool over its chat-completions model (the Responses API is
not served), tracing off so nothing leaves the machine."""

from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool, set_tracing_disabled
from agents.model_settings import ModelSettings
from openai import AsyncOpenAI

from tests.gateway.clients.tools import add, reward_of


async def run(row: dict, base_url: str, api_key: str) -> dict:
    set_tracing_disabled(True)
    calls = []

    @function_tool
    def add_numbers(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return add(a, b)

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = Agent(
        name="adder",
        instructions="Answer with the number.",
        tools=[add_numbers],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
        model_settings=ModelSettings(max_tokens=96),
    )
    result = await Runner.run(agent, row["prompt"], max_turns=3, run_config=RunConfig(tracing_disabled=True))
    return {"reward": reward_of(str(result.final_output), row), "metrics": {"tool_calls": len(calls)}}
