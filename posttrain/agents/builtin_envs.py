"""Pieces of the built-in agentic tasks: a safe ``calculator`` tool, its environment, and ``guess_number``."""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any

from posttrain.agents.env import Environment, Message, StepResult, ToolEnvironment
from posttrain.agents.tools import ToolSet, make_tool
from posttrain.data.tasks.guess_number import guess_number_rules

MAX_EXPRESSION_CHARS = 200
MAX_NODES = 64
MAX_ABS_VALUE = 10**30
MAX_EXPONENT = 64

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_evaluate(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        value = _BINARY[type(node.op)](left, right)
    else:
        raise ValueError(f"unsupported syntax {type(node).__name__}: only numbers, + - * / // % ** and ( )")
    if isinstance(value, complex) or abs(value) > MAX_ABS_VALUE:
        raise ValueError(f"the result is out of range (|x| <= 1e{len(str(MAX_ABS_VALUE)) - 1})")
    return value


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: numbers with + - * / // % ** and parentheses, for example "(1234 * 5678) - 9".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(
            f"the expression is {len(expression)} characters long (at most {MAX_EXPRESSION_CHARS})"
        )
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}: {exc.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ValueError(f"the expression has too many parts (at most {MAX_NODES})")
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


class CalculatorEnv(ToolEnvironment):
    """The ``calculator`` task's environment: a :class:`ToolEnvironment` with the ``calculator`` tool.

    A run with ``env.path=calculator`` leaves the tool block out of the prompt unless
    `rollout.multi_turn.render_tools` is set (posttrain.config.schema.names.SCHEMAS_HIDDEN_BY_DEFAULT): with the
    built-in tiny tokenizer that block is over 500 tokens, ten times the rest of a trajectory, and the SFT warm
    start teaches the call format instead.
    """

    def __init__(self, max_parallel_calls: int = 4, timeout_s: float = 5.0) -> None:
        super().__init__(ToolSet([make_tool(calculator)]), max_parallel_calls, timeout_s)


_INTEGER = re.compile(r"-?\d+")


class GuessNumberEnv(Environment):
    """Guess a hidden integer in [low, high]: each wrong guess is answered "Higher." or "Lower.".

    The reward is 1.0 when the number is found within ``max_turns`` guesses, else 0.0 (on the last turn). The row's
    ``target`` (or ``extra.target``) is the number; without one it is drawn from ``row["seed"]``. The row's
    ``low``, ``high`` and ``max_turns`` (or in ``extra``: the built-in task writes them there) override the constructor's.
    A row without a ``prompt`` gets the rules as its opening message.
    """

    def __init__(self, low: int = 1, high: int = 100, max_turns: int = 7) -> None:
        self.low, self.high, self.max_turns = low, high, max_turns
        self.target = low
        self.guesses = 0
        self.solved = False

    def reset(self, row: dict[str, Any]) -> list[Message] | None:
        extra = row.get("extra") or {}
        self.low = int(row.get("low", extra.get("low", self.low)))
        self.high = int(row.get("high", extra.get("high", self.high)))
        self.max_turns = int(row.get("max_turns", extra.get("max_turns", self.max_turns)))
        target = row.get("target", extra.get("target"))
        if target is None:
            target = random.Random(row.get("seed", 0)).randint(self.low, self.high)
        self.target, self.guesses, self.solved = int(target), 0, False
        if row.get("prompt"):
            return None
        return [{"role": "user", "content": self.rules()}]

    def rules(self) -> str:
        return guess_number_rules(self.low, self.high, self.max_turns)

    def step(self, text: str) -> StepResult:
        found = _INTEGER.findall(text)
        self.guesses += 1
        last = self.guesses >= self.max_turns
        if not found:
            return StepResult([{"role": "user", "content": "Answer with one whole number."}], done=last)
        guess = int(found[-1])
        if guess == self.target:
            self.solved = True
            return StepResult([], reward=1.0, done=True)
        hint = "Higher." if guess < self.target else "Lower."
        return StepResult([] if last else [{"role": "user", "content": hint}], done=last)

    def metrics(self) -> dict[str, float]:
        return {"guesses": float(self.guesses), "solved": float(self.solved)}
