"""LangGraph: the prebuilt ReAct agent over LangChain's ChatOpenAI with one tool."""

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from tests.gateway.clients.tools import add, reward_of


def run(row: dict, base_url: str, api_key: str) -> dict:
    calls = []

    @tool
    def add_numbers(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return add(a, b)

    model = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_tokens=96, max_retries=0)
    agent = create_react_agent(model, [add_numbers])
    state = agent.invoke({"messages": [("user", row["prompt"])]}, {"recursion_limit": 6})
    answer = state["messages"][-1].content
    return {"reward": reward_of(str(answer), row), "metrics": {"tool_calls": len(calls)}}
