"""reasoning-gym tasks as built-in data, against the real package: seeded, split without overlap, scored by the
package's own score_answer."""

import pytest

from posttrain.config.errors import ConfigError
from posttrain.config.load import build_config
from posttrain.data.splits import load_splits
from posttrain.data.tasks import load_task
from posttrain.rewards.functions import resolve_reward_function

pytest.importorskip("reasoning_gym")


def test_generated_from_the_seed_split_without_overlap():
    train, val = load_task("reasoning_gym:basic_arithmetic", seed=3, n_train=200, n_val=50)
    assert (len(train), len(val)) == (200, 50)
    assert not {r.prompt for r in train} & {r.prompt for r in val}
    again, _ = load_task("reasoning_gym:basic_arithmetic", seed=3, n_train=200, n_val=50)
    assert [r.prompt for r in again] == [r.prompt for r in train]
    other, _ = load_task("reasoning_gym:basic_arithmetic", seed=4, n_train=200, n_val=50)
    assert [r.prompt for r in other] != [r.prompt for r in train]


def test_questions_are_distinct():
    # Generators may repeat a question; the split holds each question once.
    train, val = load_task("reasoning_gym:basic_arithmetic", seed=0, n_train=30, n_val=10)
    prompts = [r.prompt for r in train + val]
    assert len(prompts) == len(set(prompts))


def test_scored_by_the_package_score_answer():
    train, _ = load_task("reasoning_gym:basic_arithmetic", seed=1, n_train=5, n_val=1)
    fn = resolve_reward_function("reasoning_gym")
    r = train[0]
    assert fn(r.prompt, r.ground_truth, r.ground_truth, r.extra) == 1.0
    assert fn(r.prompt, f"thinking... <answer>{r.ground_truth}</answer>", r.ground_truth, r.extra) == 1.0
    assert fn(r.prompt, "<answer>not a number</answer>", r.ground_truth, r.extra) == 0.0
    assert r.extra["data_source"] == "reasoning_gym:basic_arithmetic"


def test_config_and_errors():
    cfg = build_config(
        overrides=[
            "data.task=reasoning_gym:basic_arithmetic",
            "data.num_train_examples=20",
            "data.num_val_examples=5",
        ]
    )
    splits = load_splits(cfg)
    assert (len(splits.train), len(splits.val), splits.reward_spec) == (20, 5, "reasoning_gym")
    with pytest.raises(ConfigError, match="reasoning-gym has no task 'nope'"):
        load_splits(build_config(overrides=["data.task=reasoning_gym:nope"]))
    with pytest.raises(ConfigError, match="reasoning_gym:<name>"):
        build_config(overrides=["data.task=aritmetic"])


def test_task_options_reach_the_generator():
    # data.task_options.* are the fields of the task's own config class: gcd's numbers stay within max_value.
    cfg = build_config(
        overrides=[
            "data.task=reasoning_gym:gcd",
            "data.task_options.max_value=12",
            "data.num_train_examples=40",
            "data.num_val_examples=8",
        ]
    )
    splits = load_splits(cfg)
    assert (len(splits.train), len(splits.val)) == (40, 8)
    for r in splits.train + splits.val:
        numbers = r.extra["reasoning_gym_entry"]["metadata"]["numbers"]
        assert all(1 <= n <= 12 for n in numbers), r.prompt
        assert int(r.ground_truth) <= 12
    plain = load_splits(build_config(overrides=["data.task=reasoning_gym:gcd", "data.num_train_examples=40"]))
    assert max(n for r in plain.train for n in r.extra["reasoning_gym_entry"]["metadata"]["numbers"]) > 12


def test_task_option_errors_name_the_key():
    def load(*overrides):
        return load_splits(build_config(overrides=["data.task=reasoning_gym:gcd", *overrides]))

    with pytest.raises(
        ConfigError, match=r"'data.task_options.max_vale' = 3: .* no option 'max_vale'.*max_value"
    ):
        load("data.task_options.max_vale=3")
    with pytest.raises(
        ConfigError, match=r"data.task_options.min_value=20, .*refuses them \(max_value must be"
    ):
        load("data.task_options.min_value=20", "data.task_options.max_value=3")
    with pytest.raises(ConfigError, match=r"'data.task_options.n_train' = 5: .*data.num_train_examples=5"):
        load("data.task_options.n_train=5")
    with pytest.raises(ConfigError, match=r"only \d+ distinct questions .* or widen data.task_options"):
        load("data.task_options.max_value=8", "data.num_train_examples=60", "data.num_val_examples=10")


def test_arithmetic_takes_its_options_from_the_config():
    cfg = build_config(overrides=["data.task_options.ops=[-]", "data.num_train_examples=30"])
    assert all("-" in r.prompt and "+" not in r.prompt for r in load_splits(cfg).train)
    with pytest.raises(ConfigError, match=r"'data.task_options.digits'.*its options are"):
        load_splits(build_config(overrides=["data.task_options.digits=3"]))


def test_validation_is_drawn_like_training_in_a_small_question_space():
    # gcd retries for an answer above 1, so in a nearly exhausted space the questions first seen late are gcd-1
    # ones: cut from the end, all 64 validation questions had answer 1. The split is made after a seeded shuffle.
    train, val = load_task("reasoning_gym:gcd", seed=1, n_train=640, n_val=64, max_value=30)
    share = sum(r.ground_truth == "1" for r in val) / len(val)
    assert 0.2 < share < 0.7, share
    assert abs(share - sum(r.ground_truth == "1" for r in train) / len(train)) < 0.2


def test_explain_and_train_check_task_options_before_anything_loads():
    from posttrain.planning.preflight import preflight

    cfg = build_config(overrides=["data.task=reasoning_gym:gcd", "data.task_options.max_vale=40"])
    with pytest.raises(ConfigError, match="'data.task_options.max_vale' = 40"):
        preflight(cfg, "train", check_model=False)
    preflight(
        build_config(overrides=["data.task=reasoning_gym:gcd", "data.task_options.max_value=40"]), "train"
    )
