"""Built-in arithmetic task: generation, splits, reward, registry."""

import re

import pytest

from posttrain.config.load import build_config
from posttrain.data.splits import load_splits
from posttrain.data.tasks import TASKS, get_task, load_task
from posttrain.data.tasks.arithmetic import (
    arithmetic_problem_count,
    arithmetic_reward,
    make_arithmetic_splits,
)
from posttrain.planning.input_checks import _check_task_options as check_task_options
from posttrain.rewards.functions import REWARD_FUNCTIONS


def test_deterministic_and_seed_dependent():
    a = make_arithmetic_splits(seed=1, n_train=50, n_val=10)
    assert a == make_arithmetic_splits(seed=1, n_train=50, n_val=10)
    assert a != make_arithmetic_splits(seed=2, n_train=50, n_val=10)


def test_splits_are_disjoint_and_answers_correct():
    train, val = make_arithmetic_splits(seed=0, n_train=300, n_val=100, max_digits=2)
    assert len(train) == 300 and len(val) == 100
    keys = [r.prompt for r in train + val]
    assert len(set(keys)) == 400
    for record in train + val:
        a, op, b = record.extra["a"], record.extra["op"], record.extra["b"]
        assert record.prompt == f"What is {a} {op} {b}?"
        assert record.ground_truth == str(a + b if op == "+" else a - b)
        assert int(record.ground_truth) >= 0  # allow_negative=False by default
        assert 0 <= a < 100 and 0 <= b < 100


def test_digit_and_op_options():
    train, _ = make_arithmetic_splits(
        seed=0, n_train=50, n_val=0, min_digits=3, max_digits=3, ops=("-",), allow_negative=True
    )
    assert all(r.extra["op"] == "-" and 100 <= r.extra["a"] <= 999 for r in train)
    assert any(int(r.ground_truth) < 0 for r in train)


def test_whole_problem_space_can_be_drawn():
    total = arithmetic_problem_count(max_digits=1)  # 100 sums + 55 ordered differences
    assert total == 155
    train, val = make_arithmetic_splits(seed=0, n_train=150, n_val=5, max_digits=1)
    assert len({r.prompt for r in train + val}) == 155
    with pytest.raises(ValueError, match="exceeds the 155 distinct problems"):
        make_arithmetic_splits(seed=0, n_train=150, n_val=6, max_digits=1)


def test_bad_options():
    with pytest.raises(ValueError, match=r"supported operations are \('\+', '-'\)"):
        make_arithmetic_splits(seed=0, n_train=5, n_val=5, ops=("*",))


@pytest.mark.parametrize(
    "response, expected",
    [
        ("81", 1.0),
        (" 81\n", 1.0),
        ("81<|im_end|>", 1.0),
        ("81 is the answer", 1.0),
        ("The answer is 81.", 1.0),
        ("8", 0.0),
        ("810", 0.0),
        ("81.5", 0.0),
        ("-81", 0.0),
        ("23 + 58 = 81", 0.0),
        ("", 0.0),
        ("eighty-one", 0.0),
    ],
)
def test_arithmetic_reward(response, expected):
    assert arithmetic_reward("What is 23 + 58?", response, "81", {}) == expected


def test_arithmetic_reward_negative_answer():
    assert arithmetic_reward("What is 3 - 5?", "-2", "-2", {}) == 1.0
    assert arithmetic_reward("What is 3 - 5?", "2", "-2", {}) == 0.0


def test_registry():
    assert set(TASKS) == {"arithmetic", "gsm8k", "calculator", "guess_number", "python_arithmetic"}
    for task in TASKS.values():
        assert task.default_reward in REWARD_FUNCTIONS
    train, val = load_task("arithmetic", seed=0, n_train=20, n_val=5)
    assert (len(train), len(val)) == (20, 5)
    with pytest.raises(ValueError, match="no option.*n_test.*n_train"):
        load_task("arithmetic", seed=0, n_test=5)
    with pytest.raises(
        ValueError, match=r"unknown task 'math'.*\['arithmetic', 'calculator', 'gsm8k', 'guess_number'"
    ):
        get_task("math")


def test_max_operand_reaches_the_arithmetic_task_only():
    """data.max_operand bounds the arithmetic task's operands; the other tasks have no such option (a loader
    asked for it refuses it), so the run does not pass it to them."""
    overrides = ["data.max_operand=9", "data.num_train_examples=30", "data.num_val_examples=10"]
    bounded = load_splits(build_config(overrides=overrides))
    operands = [int(n) for r in bounded.train for n in re.findall(r"\d+", r.prompt)]
    assert operands and max(operands) <= 9
    for task in ("calculator", "guess_number", "python_arithmetic"):
        cfg = build_config(
            overrides=[f"data.task={task}", "data.num_train_examples=4", "data.num_val_examples=2"]
        )
        assert len(load_splits(cfg).train) == 4
        with pytest.raises(ValueError, match=r"no option\(s\) \['max_operand'\]"):
            load_task(task, seed=0, n_train=1, n_val=1, max_operand=9)


def test_the_start_up_check_of_task_options_passes_max_operand_the_same_way():
    """The check that data.task_options fit the task (run before every command) generates with the same
    arguments as the run: data.max_operand for the arithmetic task only."""
    for overrides in (
        ["data.task=calculator", "data.task_options.min_digits=1"],
        ["data.task_options.max_digits=1", "data.max_operand=5"],
    ):
        check_task_options(build_config(overrides=overrides))
    with pytest.raises(ValueError, match="max_operand=5 leaves no operand with at least 2 digit"):
        check_task_options(build_config(overrides=["data.task_options.min_digits=2", "data.max_operand=5"]))
