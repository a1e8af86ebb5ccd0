"""Rule + reward model (+ judge) in one run: the weights, the normalisation, both parts logged (posttrain.rewards.combine)."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.models.hf import load_tokenizer
from posttrain.rewards.combine import RewardWeights, combine_rewards
from posttrain.rl.train_command import run_training
from tests.helpers import read_metrics, small_config


def test_weights_and_normalisation_by_hand():
    rule = torch.tensor([1.0, 0.0, 1.0, 0.5])
    model = torch.tensor([2.0, -1.0, 0.0, 4.0])
    w = RewardWeights(rule=0.5, model=2.0, mean=1.0, std=2.0)
    total, metrics = combine_rewards(rule, model, w)
    expected = 0.5 * rule + 2.0 * (model - 1.0) / 2.0
    assert torch.equal(total, expected)
    assert metrics == {
        "reward/rule_mean": pytest.approx(0.625),
        "reward/rule_accuracy": 0.5,
        "reward/model_score_mean": pytest.approx(float(((model - 1.0) / 2.0).mean())),
    }
    alone, metrics = combine_rewards(rule, None, RewardWeights())
    assert torch.equal(alone, rule) and "reward/model_score_mean" not in metrics
    empty, metrics = combine_rewards(torch.zeros(0), torch.zeros(0), w)
    assert len(empty) == 0 and metrics["reward/model_score_mean"] == 0.0


def test_a_judge_score_adds_with_its_weight():
    rule = torch.tensor([1.0, 0.0])
    model = torch.tensor([2.0, -1.0])
    judge = torch.tensor([0.25, 1.0])
    w = RewardWeights(rule=0.5, model=2.0, mean=1.0, std=2.0, judge=3.0)
    total, _ = combine_rewards(rule, model, w, judge)
    assert torch.equal(total, 0.5 * rule + 2.0 * (model - 1.0) / 2.0 + 3.0 * judge)
    judge_only, _ = combine_rewards(rule, None, RewardWeights(rule=0.0, judge=2.0), judge)
    assert torch.equal(judge_only, 2.0 * judge)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["reward.rule_weight=0"], "reward.model.enable=false"),
        (["reward.model.normalize=true"], "reward.model.enable=false"),
        (
            [
                "reward.model.enable=true",
                "reward.model.path=x",
                "reward.rule_weight=0",
                "reward.model.weight=0",
            ],
            "nothing to train on",
        ),
    ],
)
def test_weights_without_a_model_or_all_zero_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_config(overrides=overrides)


def _reward_model(tmp_path, tiny_model_dir, stats=None):
    tok = load_tokenizer(tiny_model_dir)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, num_labels=1, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    for key, value in (stats or {}).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    path = tmp_path / "rm"
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_a_run_trains_on_the_weighted_sum_and_logs_both_parts(tiny_model_dir, tmp_path):
    rm = _reward_model(tmp_path, tiny_model_dir, {"reward_mean": 0.3, "reward_std": 0.05})
    cfg = small_config(
        tiny_model_dir, tmp_path / "run", "reward.model.enable=true", f"reward.model.path={rm}",
        "reward.rule_weight=0.5", "reward.model.weight=2.0", "reward.model.normalize=true",
    )  # fmt: skip
    run_training(cfg, quiet=True)
    for row in read_metrics(tmp_path / "run"):
        combined = 0.5 * row["reward/rule_mean"] + 2.0 * row["reward/model_score_mean"]
        assert row["reward/mean"] == pytest.approx(combined, abs=1e-5)
        assert row["reward/rule_mean"] != 0.0  # the varied rule reward of the test config is on
        # a threshold on a sum with a model score means nothing: the rule's own accuracy is logged instead
        assert "reward/accuracy" not in row and "reward/rule_accuracy" in row


def test_normalize_needs_the_stats_in_the_model(tiny_model_dir, tmp_path):
    rm = _reward_model(tmp_path, tiny_model_dir)
    cfg = small_config(
        tiny_model_dir, tmp_path / "run", "reward.model.enable=true", f"reward.model.path={rm}",
        "reward.model.normalize=true",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="no reward_mean and reward_std"):
        run_training(cfg, quiet=True)
