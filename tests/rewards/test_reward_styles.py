"""A user's reward function in any of the three accepted styles, told apart by its signature."""

import pytest

from posttrain.config.errors import ConfigError
from posttrain.rewards.functions import resolve_reward_function
from posttrain.rewards.runner import RewardInput, RewardRunner

STYLES = """
def ours(prompt, response, ground_truth, extra):
    return float(response == ground_truth) + extra.get("bonus", 0)

def keywords(prompt=None, response="", ground_truth="", **kwargs):
    return float(response == ground_truth) + kwargs["extra"].get("bonus", 0)

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"words": 1.0, "other": 0.5}[data_source] * float(solution_str == ground_truth)

def old_verl(solution_str, ground_truth):
    return float(solution_str == ground_truth)

def wrong(text):
    return 0.0
"""


@pytest.fixture
def rewards(tmp_path):
    path = tmp_path / "styles.py"
    path.write_text(STYLES)
    return path


@pytest.mark.parametrize("name", ["ours", "keywords", "compute_score", "old_verl"])
def test_each_style_scores_through_the_runner(rewards, name):
    fn = resolve_reward_function(f"{rewards}:{name}", data_source="words")
    samples = [RewardInput("p", "abc", "abc", {"bonus": 0}), RewardInput("p", "x", "abc", {})]
    with RewardRunner(fn, timeout_s=5) as runner:  # in worker processes, as in training
        scores, _ = runner.score(samples)
    assert scores == [1.0, 0.0]


def test_verl_data_source_comes_from_the_record_first(rewards):
    fn = resolve_reward_function(f"{rewards}:compute_score", data_source="words")
    assert fn("p", "a", "a", {"data_source": "other"}) == 0.5
    assert fn("p", "a", "a", {}) == 1.0


def test_a_signature_of_no_style_is_a_config_error_listing_the_styles(rewards):
    with pytest.raises(ConfigError, match=r"wrong' has signature \(text\).*keyword style.*compute_score"):
        resolve_reward_function(f"{rewards}:wrong")
