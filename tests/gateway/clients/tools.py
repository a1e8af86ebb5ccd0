"""The one tool every client agent offers: adding two integers (a reply that calls it is easy to script)."""

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add_numbers",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return int(a) + int(b)


def reward_of(answer: str | None, row: dict) -> float:
    """1.0 when the final answer holds the row's ground truth."""
    return float(str(row.get("ground_truth", "")) in (answer or ""))
