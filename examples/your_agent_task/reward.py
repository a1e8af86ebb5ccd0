"""The reward of docs/your-agent-task.md: 1.0 when the final answer repeats what the weather tool reported.

The tool's result changes from call to call, so the ground truth is in the trajectory itself: the last tool
message. ``extra["messages"]`` holds the trajectory's messages in a multi-turn run.
"""


def reward(prompt, response, ground_truth, extra):
    messages = extra.get("messages") or []
    reports = [m["content"] for m in messages if m.get("role") == "tool"]
    answers = [m["content"] for m in messages if m.get("role") == "assistant"]
    if not reports or not answers:  # no tool call: the model could only guess
        return 0.0
    return 1.0 if answers[-1].strip() == reports[-1].strip() else 0.0
