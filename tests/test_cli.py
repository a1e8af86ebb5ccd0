"""The command line: explain output, JSON, key listing, and config errors (exit 2, no traceback)."""

import json
import subprocess
import sys

import pytest

from posttrain import __version__
from posttrain.cli import main

SEED_004 = [
    "data.train_batch_size=1024",
    "data.num_train_examples=1024",  # the built-in task's prompts: a step draws 1024
    "rollout.n=4",
    "actor.ppo_mini_batch_size=64",
    "actor.ppo_micro_batch_size_per_gpu=1",
    "--world-size",
    "4",
]


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "posttrain", *args], capture_output=True, text=True, timeout=120
    )


def test_version():
    out = run_cli("--version")
    assert out.returncode == 0 and __version__ in out.stdout


def test_explain_tree_has_the_numbers(capsys):
    assert main(["explain", *SEED_004]) == 0
    text = capsys.readouterr().out
    assert "4096 samples per step" in text
    assert "16 optimizer steps per step" in text
    assert "64 gradient-accumulation steps per mini-batch" in text


def test_explain_says_where_old_log_probs_come_from_and_how_prompts_are_grouped(capsys):
    args = [
        "algorithm.rollout_correction.bypass_mode=true",
        "actor.use_prefix_grouper=true",
        "actor.log_prob_micro_batch_size_per_gpu=60",
    ]
    assert main(["explain", *args]) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())  # lines wrap inside the tree
    assert "old log-probs: the rollout engine's, no forward pass" in text
    assert "prefix grouper: each prompt runs once" in text
    assert "actor.log_prob_micro_batch_size_per_gpu not a multiple of rollout.n" in text


def test_explain_json_is_stable(capsys):
    assert main(["explain", "--json", *SEED_004]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["samples_per_step"] == 4096
    assert plan["actor"]["optimizer_steps_per_step"] == 16
    assert plan["actor"]["grad_accum_steps"] == 64
    assert plan["actor"]["dp_size"] == 4
    assert set(plan) >= {
        "world_size",
        "prompts_per_step",
        "n",
        "actor",
        "old_log_prob",
        "ref",
        "critic",
        "max_policy_lag",
    }


def test_explain_keys_lists_units(capsys):
    assert main(["explain", "--keys"]) == 0
    text = capsys.readouterr().out
    assert "actor.ppo_mini_batch_size (int, default 16, range 1..) [prompts]:" in text
    assert "model.dtype (str, default fp32, one of fp32|bf16|fp16):" in text
    assert "actor.optim.lr (float, default 0.0002" in text  # a section's own default, not the class's


def test_train_help_shows_examples_and_points_to_the_keys(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "examples:" in text and "posttrain explain --keys" in text and "docs/config.md" in text


@pytest.mark.parametrize(
    "args, keys",
    [
        (["actor.ppo_mini_batch_size=300", "data.train_batch_size=1024"], ["actor.ppo_mini_batch_size"]),
        (["actor.ppo_micro_batch_size_per_gpu=3"], ["actor.ppo_micro_batch_size_per_gpu"]),
        (["actor.ppo_mini_bach_size=3"], ["actor.ppo_mini_bach_size", "actor.ppo_mini_batch_size"]),
        (["missing.yaml"], ["missing.yaml"]),
    ],
)
def test_invalid_config_exits_2_without_traceback(args, keys):
    out = run_cli("explain", *args)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    for key in keys:
        assert key in out.stderr


def test_an_internal_bug_is_not_reported_as_a_config_error(monkeypatch, capsys):
    """Only ConfigError is a user error: a ValueError from deep inside (a bug, ours or a library's) keeps its
    traceback instead of becoming a one-line "error" with exit code 2."""
    from posttrain.algorithms import advantages
    from posttrain.config.errors import ConfigError
    from posttrain.rl import train_command

    def buggy(cfg, quiet=False):
        advantages.get_advantage_estimator("no-such-estimator")  # a ValueError from a pure function

    monkeypatch.setattr(train_command, "run_training", buggy)
    with pytest.raises(ValueError, match="no-such-estimator") as info:
        main(["train"])
    assert not isinstance(info.value, ConfigError)

    def user_error(cfg, quiet=False):
        raise ConfigError("data.train_files: 'missing.jsonl' does not exist")

    monkeypatch.setattr(train_command, "run_training", user_error)
    assert main(["train"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_the_cli_hides_the_libraries_own_progress_bars(tiny_model_dir, tmp_path, capfd):
    """transformers' "Loading weights" / "Writing model shards" bars would break the training display."""
    import transformers.utils.logging as hf_logging
    from transformers import AutoModelForCausalLM

    try:
        assert main(["explain"]) == 0
        capfd.readouterr()
        assert not hf_logging.is_progress_bar_enabled()
        AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "saved")
        err = capfd.readouterr().err
        assert "Loading weights" not in err and "Writing model shards" not in err, err
    finally:
        hf_logging.enable_progress_bar()


def test_overrides_may_follow_options(capsys):
    """`explain --json key=value`: overrides after an option reach the config (argparse alone refuses them)."""
    assert main(["explain", "--json", "rollout.n=4", "data.train_batch_size=16"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["samples_per_step"] == 64
    with pytest.raises(SystemExit):
        main(["explain", "--json", "--no-such-option"])
