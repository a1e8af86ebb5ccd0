"""Built-in reward registry and user reward functions loaded by path."""

import pytest

from posttrain.rewards.functions import (
    REWARD_FUNCTIONS,
    SANDBOX_REWARD_NAMES,
    exact_match_reward,
    resolve_reward_function,
)

USER_FILE = """
import math

THRESHOLD = 3

def length_reward(prompt, response, ground_truth, extra):
    return float(len(response) > THRESHOLD)

def _helper():
    pass

def too_few(prompt, response):
    return 0.0

not_a_function = 42
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FILE)
    return path


def test_registry_names():
    assert set(REWARD_FUNCTIONS) | set(SANDBOX_REWARD_NAMES) == {
        "exact_match",
        "arithmetic",
        "gsm8k",
        "gsm8k_strict",
        "gsm8k_flexible",
        "math_verify",
        "reasoning_gym",
        "data_source",
        "data_source_code",
        "code",
        "calculator",
        "environment",
    }
    for name, fn in REWARD_FUNCTIONS.items():
        assert resolve_reward_function(name) is fn


def test_exact_match():
    assert exact_match_reward("p", "  yes\n", "yes", {}) == 1.0
    assert exact_match_reward("p", "yes!", "yes", {}) == 0.0


def test_user_function_by_path(user_file):
    fn = resolve_reward_function(f"{user_file}:length_reward")
    assert fn("p", "long response", None, {}) == 1.0
    assert fn("p", "ab", None, {}) == 0.0
    # Resolving the same file twice imports it once.
    assert resolve_reward_function(f"{user_file}:length_reward") is fn


def test_callable_passes_through():
    assert resolve_reward_function(exact_match_reward) is exact_match_reward


def test_file_not_found(tmp_path):
    spec = f"{tmp_path}/missing.py:fn"
    with pytest.raises(ValueError, match=f"reward function '{spec}': file .*missing.py' not found"):
        resolve_reward_function(spec)


def test_function_not_found_lists_callables(user_file):
    with pytest.raises(
        ValueError, match=r"defines no 'reward'; functions defined there: \['length_reward', 'too_few'\]"
    ):
        resolve_reward_function(f"{user_file}:reward")


def test_not_callable(user_file):
    with pytest.raises(ValueError, match=r":not_a_function'.*is a int, not a function"):
        resolve_reward_function(f"{user_file}:not_a_function")


def test_wrong_signature(user_file):
    with pytest.raises(ValueError, match=r"too_few' has signature \(prompt, response\)"):
        resolve_reward_function(f"{user_file}:too_few")


def test_import_error_names_spec(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match=r"broken.py:fn'.*importing .* failed: RuntimeError\('boom'\)"):
        resolve_reward_function(f"{path}:fn")


def test_unknown_name():
    with pytest.raises(
        ValueError,
        match=r"neither a built-in \(\['arithmetic', 'calculator', 'code', 'data_source', 'data_source_code', ",
    ):
        resolve_reward_function("exactmatch")
