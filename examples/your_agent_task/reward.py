"""The reward of docs/your-agent-task.md: 1.0 when the model asked the weather tool about the question's city and
answered with what the tool reported.

The tool's result changes from call to call, so the ground truth is in the trajectory itself: the last tool
message. ``extra["messages"]`` holds the trajectory's messages in a multi-turn run. The call must name the city of
the question: a report about another city is no answer (without this check, GRPO learned to ask about one city
whatever the question and to repeat that report).
"""

from posttrain.agents.hermes import parse_tool_calls


def reward(prompt, response, ground_truth, extra):
    messages = extra.get("messages") or []
    question = messages[0]["content"] if messages else ""
    reports = [m["content"] for m in messages if m.get("role") == "tool"]
    answers = [m["content"] for m in messages if m.get("role") == "assistant"]
    if not reports or not answers:  # no tool call: the model could only guess
        return 0.0
    calls = [call for text in answers for call in parse_tool_calls(text)]
    asked = calls[-1].arguments.get("city") if calls else None
    if question != f"Weather in {asked}?":  # a call about another city (or no readable call)
        return 0.0
    return 1.0 if answers[-1].strip() == reports[-1].strip() else 0.0
