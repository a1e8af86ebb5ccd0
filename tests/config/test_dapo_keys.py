"""DAPO's keys (algorithm.filter_groups, reward.overlong_buffer, algorithm.mask_truncated_samples): off by
default as in verl, and every rule between them is a ConfigError naming the key and a fix."""

import pytest

from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config

FILTER = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"]
OVERLONG = ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.penalty_factor=1.0"]


def test_defaults_are_off():
    cfg = build_config()
    f, o = cfg.algorithm.filter_groups, cfg.reward.overlong_buffer
    assert (f.enable, f.metric, f.max_num_gen_batches) == (False, None, 0)
    assert (o.enable, o.len, o.penalty_factor, o.log) == (False, 0, 0.0, False)
    assert cfg.algorithm.mask_truncated_samples is False


def test_a_dapo_config_loads():
    cfg = build_config(
        overrides=[
            *FILTER,
            "algorithm.filter_groups.max_num_gen_batches=-1",  # verl: non-positive means no limit
            *OVERLONG,
            "reward.overlong_buffer.len=8",  # as long as the whole budget is allowed (verl's rule)
            "algorithm.mask_truncated_samples=true",
        ]
    )
    assert cfg.algorithm.filter_groups.max_num_gen_batches == -1 and cfg.reward.overlong_buffer.len == 8


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["algorithm.filter_groups.enable=true"], "algorithm.filter_groups.metric"),
        ([*FILTER, "rollout.n=1"], "rollout.n=1"),
        ([*FILTER, "rollout.temperature=0", "algorithm.adv_estimator=gae"], "rollout.temperature=0"),
        (
            [FILTER[0], "algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=true"],
            "algorithm.use_kl_in_reward",
        ),
        (["algorithm.filter_groups.metric=accuracy"], "algorithm.filter_groups.metric"),
        (OVERLONG, r"reward.overlong_buffer.len=0 .*data.max_response_length=8"),
        ([*OVERLONG, "reward.overlong_buffer.len=9"], r"reward.overlong_buffer.len=9"),
        (["reward.overlong_buffer.penalty_factor=-1"], "reward.overlong_buffer.penalty_factor"),
    ],
)
def test_rules_name_the_key(overrides, named):
    with pytest.raises(ConfigError, match=named):
        build_config(overrides=overrides)
