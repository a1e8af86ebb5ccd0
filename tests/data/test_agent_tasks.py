"""The built-in agentic tasks: calculator (a calculator tool) and guess_number (higher/lower hints)."""

import asyncio

import pytest

from posttrain.agents.build import builtin_environments
from posttrain.agents.builtin_envs import CalculatorEnv, GuessNumberEnv
from posttrain.agents.demos import demonstrations
from posttrain.agents.hermes import tool_call_text
from posttrain.config.errors import DataError
from posttrain.data.tasks import get_task, load_task
from posttrain.rewards.functions import resolve_reward_function


def test_calculator_records():
    train, val = load_task("calculator", 0, n_train=200, n_val=50)
    assert len(train) == 200 and len(val) == 50
    assert not {r.prompt for r in train} & {r.prompt for r in val}
    for r in train + val:
        a, b = r.extra["a"], r.extra["b"]
        assert 10 <= a <= 99 and 10 <= b <= 99 and r.prompt == f"What is {a} * {b}?"  # the default: 2 digits
        assert r.ground_truth == str(a * b)
    assert load_task("calculator", 0, n_train=200, n_val=50) == (train, val)
    wide, _ = load_task("calculator", 0, n_train=50, n_val=0, min_digits=3, max_digits=4)
    assert all(100 <= r.extra["a"] <= 9999 and 100 <= r.extra["b"] <= 9999 for r in wide)
    with pytest.raises(DataError, match="min_digits"):
        load_task("calculator", 0, n_train=2, n_val=1, min_digits=4, max_digits=3)


def test_calculator_demonstrations_of_one_digit_products_answer_wrong_from_memory():
    train, _ = load_task("calculator", 0, n_train=81, n_val=0, min_digits=1, max_digits=1)
    rows = demonstrations("calculator", train, 81, seed=0, rate=1.0)  # every one answers from memory
    for record, row in zip(train, rows):
        assert row["messages"][-1]["content"] != record.ground_truth


def test_calculator_reward_reads_the_final_assistant_message():
    reward = resolve_reward_function(get_task("calculator").default_reward)
    call = tool_call_text("calculator", {"expression": "123 * 456"})
    messages = [{"role": "user", "content": "What is 123 * 456?"}, {"role": "assistant", "content": call},
                {"role": "tool", "content": "56088"}, {"role": "assistant", "content": "56088"}]  # fmt: skip
    assert reward("q", "56088", "56088", {"messages": messages}) == 1.0
    assert (
        reward("q", "56089", "56088", {"messages": messages[:3] + [{"role": "assistant", "content": "5"}]})
        == 0
    )
    assert reward("q", call, "56088", {"messages": messages[:2]}) == 0.0  # a call is not an answer
    # Without the messages, the text after the last tool result is the answer.
    assert reward("q", "<tool_response>\n56088\n</tool_response>\nassistant\n56088", "56088", {}) == 1.0


def test_calculator_environment_runs_the_tool():
    assert builtin_environments()["calculator"] is CalculatorEnv
    env = CalculatorEnv()
    assert env.tool_schemas()[0]["function"]["name"] == "calculator"
    step = asyncio.run(env.step(tool_call_text("calculator", {"expression": "1234 * 5678"})))
    assert step.messages == [{"role": "tool", "content": "7006652"}] and not step.done
    assert asyncio.run(env.step("7006652")).done
    assert env.metrics()["tool_calls/calculator"] == 1.0


def test_guess_number_rows_carry_their_game():
    train, val = load_task("guess_number", 3, n_train=64, n_val=16, low=1, high=15, max_turns=4)
    assert len({r.prompt for r in train + val}) == 1 and "from 1 to 15" in train[0].prompt
    assert {r.extra["max_turns"] for r in train} == {4} and all(1 <= r.extra["target"] <= 15 for r in train)
    env = GuessNumberEnv()  # the row's range and turn limit win over the constructor's
    row = {"prompt": train[0].prompt, "extra": train[0].extra}
    assert env.reset(row) is None and (env.low, env.high, env.max_turns) == (1, 15, 4)
    target = train[0].extra["target"]
    assert env.step(str(target)).reward == 1.0
    assert get_task("guess_number").default_reward == "environment"
    assert resolve_reward_function("environment")("p", "7", "7", {"env_reward": 1.0}) == 0.0
