"""The command line answers at once: parsing it, loading a config and checking it import neither torch nor
transformers (each command imports its own modules when it runs). Checked in a fresh interpreter, where nothing
else has imported them yet."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers")


def heavy_modules_after(code: str) -> list[str]:
    """The heavy libraries in sys.modules after running ``code`` in a fresh interpreter of this checkout."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "code",
    [
        "import posttrain.cli",
        "import posttrain.config.schema, posttrain.config.load, posttrain.config.validate, posttrain.config.plan",
        # what `posttrain train` does before a misspelled key stops it: the whole config path, verl's keys too
        "from posttrain.config.load import build_config\n"
        "from posttrain.config.validate import check_config\n"
        "check_config(build_config([], ['trainer.total_steps=3', 'actor_rollout_ref.rollout.n=4']))",
        "from posttrain.cli import build_parser\nbuild_parser().format_help()",
    ],
)
def test_the_cli_and_the_config_load_without_torch(code):
    assert heavy_modules_after(code) == []


def test_a_misspelled_key_fails_without_importing_torch():
    code = "from posttrain.cli import main\nassert main(['train', 'trainer.totl_steps=3']) == 2"
    assert heavy_modules_after(code) == []


def test_a_misspelled_reward_function_fails_without_importing_torch(tmp_path):
    """docs/your-task.md: "a typo fails in a second" (the reward's file and name are checked before the rest)."""
    reward = tmp_path / "reward.py"
    reward.write_text("def reward(prompt, response, ground_truth, extra):\n    return 1.0\n")
    code = f"from posttrain.cli import main\nassert main(['train', 'reward.function={reward}:rewrd']) == 2"
    assert heavy_modules_after(code) == []


def test_eval_checks_its_reward_before_importing_torch(tmp_path):
    """`posttrain eval` scores with the reward: a misspelled one fails before the model's libraries load."""
    reward = tmp_path / "reward.py"
    reward.write_text("def reward(prompt, response, ground_truth, extra):\n    return 1.0\n")
    for model in ([], ["--model", "builtin:base"]):
        code = f"from posttrain.cli import main\nassert main(['eval', *{model!r}, 'reward.function={reward}:rewrd']) == 2"
        assert heavy_modules_after(code) == []
