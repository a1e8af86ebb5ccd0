"""A calculator agent written only against the `openai` package (nothing from posttrain), trained as a harness:

    posttrain train model.path=Qwen/Qwen2.5-0.5B-Instruct data.task=arithmetic \
        data.task_options.min_digits=3 data.task_options.max_digits=4 \
        harness.path=examples/agents/openai_calculator_agent.py:run

It asks the policy the row's question offering a `calculator` tool, runs each tool call it gets back, sends the
results and repeats, up to MAX_CALLS model calls. The reward is 1.0 when the first number of the final answer is
the row's ground truth.
"""

import ast
import json
import operator
import re

import openai

MAX_CALLS = 3
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": 'for example "52 * 67"'}},
            "required": ["expression"],
        },
    },
}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(node: ast.AST) -> float:
    """Numbers and + - * / only: the model's text is never run as code."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
    raise ValueError("only numbers, + - * / and parentheses")


def calculator(arguments: str) -> str:
    """The tool's result as text; a bad call's error is the result (the model sees it and may retry)."""
    try:
        value = evaluate(ast.parse(str(json.loads(arguments)["expression"]), mode="eval").body)
        return str(int(value) if float(value).is_integer() else round(value, 6))
    except (ValueError, KeyError, TypeError, SyntaxError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {exc}"


def reward(answer: str | None, ground_truth: str) -> float:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer or "")
    return float(bool(numbers) and numbers[0] == str(ground_truth).strip())


def run(row: dict, base_url: str, api_key: str) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    tool_calls = 0
    for _ in range(MAX_CALLS):
        message = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = message.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            tool_calls += 1
            result = calculator(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = messages[-1].get("content") if messages[-1]["role"] == "assistant" else None
    return {"reward": reward(answer, row["ground_truth"]), "metrics": {"tool_calls": tool_calls}}
