"""smolagents: a ToolCallingAgent with one tool through its OpenAIServerModel."""

import importlib.resources

import yaml
from smolagents import OpenAIServerModel, Tool, ToolCallingAgent

from tests.gateway.clients.tools import add, reward_of


class AddTool(Tool):
    name = "add_numbers"
    description = "Add two integers."
    inputs = {
        "a": {"type": "integer", "description": "the first integer"},
        "b": {"type": "integer", "description": "the second integer"},
    }
    output_type = "integer"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, a: int, b: int) -> int:
        self.calls += 1
        return add(a, b)


# The library's own system prompt is ~2,900 tokens, more than the tiny test model's context: a short one instead
# (the rest of its templates, used when the step limit is reached, are the library's).
SYSTEM_PROMPT = (
    "Solve the task with the tools{%- for tool in tools.values() %} {{ tool.name }}{%- endfor %}; "
    "give the result with final_answer."
)


def prompt_templates() -> dict:
    text = importlib.resources.files("smolagents.prompts").joinpath("toolcalling_agent.yaml").read_text()
    return {**yaml.safe_load(text), "system_prompt": SYSTEM_PROMPT}


def run(row: dict, base_url: str, api_key: str) -> dict:
    model = OpenAIServerModel(
        model_id="policy", api_base=base_url, api_key=api_key, max_tokens=96, client_kwargs={"max_retries": 0}
    )
    adder = AddTool()
    agent = ToolCallingAgent(
        tools=[adder], model=model, max_steps=2, verbosity_level=0, prompt_templates=prompt_templates()
    )
    answer = agent.run(row["prompt"])
    return {"reward": reward_of(str(answer), row), "metrics": {"tool_calls": adder.calls}}
