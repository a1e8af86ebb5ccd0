"""Config input shapes and values that used to surface as tracebacks or silent nonsense: each is one
message naming the key, exit code 2, before any heavy work."""

from __future__ import annotations

import pytest

from posttrain.cli import main
from tests.helpers import small_overrides


def _run(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize(
    "yaml_text, key",
    [
        ("actor:\n  optim: 5\n", "actor.optim"),
        ("data:\n  - 1\n  - 2\n", "data"),
        ("data: 5\n", "data"),
    ],
)
def test_a_section_given_a_value_in_yaml_names_the_key(tmp_path, capsys, yaml_text, key):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    code, err = _run(capsys, "explain", str(path))
    assert code == 2 and f"'{key}' is a section" in err


@pytest.mark.parametrize("command", ["explain", "train"])
def test_a_section_given_a_value_on_the_command_line_names_the_key(capsys, command):
    code, err = _run(capsys, command, "data=5")
    assert code == 2 and "'data' is a section" in err and "data.task" in err


def test_a_bare_key_reads_as_an_override_missing_its_value(capsys):
    code, err = _run(capsys, "train", "actor.ppo_mini_batch_size")
    assert code == 2 and "looks like a config override missing '=value'" in err


def test_a_duplicated_override_warns_which_value_wins(capsys):
    with pytest.warns(
        UserWarning, match="trainer.total_steps is given twice .* the last one wins: trainer.total_steps=7"
    ):
        code, _ = _run(capsys, "explain", "--json", "trainer.total_steps=3", "trainer.total_steps=7")
    assert code == 0


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (["rollout.top_k=0"], "rollout.top_k", "-1 to disable"),
        (["trainer.loggers=[console,jsonll]"], "trainer.loggers", "tensorboard"),
        (["rollout.temperature=0", "rollout.n=4"], "rollout.temperature=0", "advantage would be zero"),
        (["rollout.temperature=0", "algorithm.adv_estimator=rloo"], "rloo", "rollout.temperature > 0"),
    ],
)
def test_values_that_cannot_work_are_refused_before_training(capsys, overrides, key, words):
    code, err = _run(capsys, "train", *overrides)
    assert code == 2 and key in err and words in err


def test_greedy_rollouts_without_a_group_estimator_are_allowed(capsys):
    assert _run(capsys, "explain", "--json", "rollout.temperature=0", "algorithm.adv_estimator=gae")[0] == 0
    n1 = ["rollout.n=1", "algorithm.adv_estimator=remax", "actor.ppo_micro_batch_size_per_gpu=16"]
    assert _run(capsys, "explain", "--json", "rollout.temperature=0", *n1)[0] == 0


def test_fail_fast_reward_error_is_the_users_not_the_trainers(tiny_model_dir, tmp_path, capsys):
    reward = tmp_path / "broken.py"
    reward.write_text(
        "def broken(prompt, response, ground_truth, extra):\n    raise KeyError('oops in my reward')\n"
    )
    args = small_overrides(
        tiny_model_dir, tmp_path / "run", f"reward.function={reward}:broken", "reward.fail_fast=true"
    )
    code = main(["train", *args, "trainer.total_steps=1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "oops in my reward" in err and "reward.fail_fast=true" in err and "broken.py" in err
    assert "posttrain/rl/" not in err  # no frame of the trainer
