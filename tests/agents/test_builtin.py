"""The calculator tool (safe: no eval/exec, bounded sizes) and the guess_number environment."""

import pytest

from posttrain.agents.builtin_envs import GuessNumberEnv, calculator
from posttrain.agents.tools import schema_from_function


@pytest.mark.parametrize(
    "expression, result",
    [("1234 * 5678", "7006652"), ("(2 + 3) * -4", "-20"), ("7 / 2", "3.5"), ("8 / 2", "4"), ("2 ** 10", "1024"),
     ("17 // 5 + 17 % 5", "5"), (" 1.5 * 2 ", "3"), ("10 / 3", "3.333333")],
)  # fmt: skip
def test_calculator(expression, result):
    assert calculator(expression) == result


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('true')", "unsupported syntax Call"),
        ("open('/etc/passwd')", "unsupported syntax Call"),
        ("x + 1", "unsupported syntax Name"),
        ("(1).__class__", "unsupported syntax Attribute"),
        ("[1, 2]", "unsupported syntax List"),
        ("'a' * 3", "unsupported syntax Constant"),
        ("9 ** 9 ** 9", "exponent .* is too large"),
        ("10 ** 40", "out of range"),
        ("1 / 0", "division by zero"),
        ("1 +", "cannot parse"),
        ("1+" * 150 + "1", "characters long"),
        ("+".join(["1"] * 40), "too many parts"),
    ],
)
def test_calculator_refuses_anything_but_bounded_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


def test_calculator_schema():
    fn = schema_from_function(calculator)["function"]
    assert fn["name"] == "calculator" and fn["parameters"]["required"] == ["expression"]
    assert "(1234 * 5678) - 9" in fn["parameters"]["properties"]["expression"]["description"]


def test_guess_number():
    env = GuessNumberEnv(low=1, high=10, max_turns=3)
    assert env.reset({"prompt": "guess", "target": 6}) is None
    assert env.step("5").messages == [{"role": "user", "content": "Higher."}]
    assert env.step("My guess is 8").messages == [{"role": "user", "content": "Lower."}]
    last = env.step("6")
    assert (last.reward, last.done, env.metrics()) == (1.0, True, {"guesses": 3.0, "solved": 1.0})

    env.reset({"extra": {"target": 2}})
    assert env.step("no idea").messages[0]["content"] == "Answer with one whole number."
    env.step("3")
    out = env.step("4")  # the third guess is the last: done, no reward, no more hints
    assert (out.reward, out.done, out.messages) == (0.0, True, [])

    opening = GuessNumberEnv().reset({"seed": 3})
    assert "from 1 to 100" in opening[0]["content"]
    assert GuessNumberEnv().reset({"seed": 3}) == opening
