"""Every command that scores code builds the run's sandbox from its `sandbox.*` section, not the defaults: SFT
validation, and the reward runner that `posttrain train` and `posttrain eval` share."""

import json
from pathlib import Path

from posttrain.config.load import build_config
from posttrain.data.records import PromptRecord
from posttrain.rewards import code
from posttrain.rl.build import build_reward_runner

ROWS = [json.loads(line) for line in (Path(__file__).parents[2] / "examples/code/tiny_code.jsonl").open()]
SETTINGS = ["sandbox.time_limit_s=1.5", "sandbox.max_concurrent=3", "sandbox.memory_limit_mb=300"]


def assert_run_settings(fn) -> None:
    """``fn``: the code reward a command built (or verl's data_source scorer holding it)."""
    reward = getattr(fn, "code", fn)
    sandbox = reward.sandbox
    assert sandbox.max_concurrent == 3
    assert sandbox.limits.time_limit_s == 1.5
    assert sandbox.limits.memory_limit_mb == 300
    # ...and the code reward runs in it: an endless loop stops at the run's 1.5 s, on each of its 3 cases.
    before = code.COUNTS.copy()
    looping = "```python\nwhile True: pass\n```"
    assert reward("", looping, ROWS[0]["answer"], {}) == 0.0
    assert code.COUNTS["time_limits"] - before["time_limits"] == 3


def test_sft_validation_uses_the_run_sandbox(sandbox, tiny_model_dir, tmp_path):
    from posttrain.models.hf import load_tokenizer
    from posttrain.sft.validation import SFTValidator
    from tests.helpers import sft_config

    cfg = sft_config(tiny_model_dir, tmp_path, "reward.function=code", *SETTINGS)
    records = [PromptRecord("Add a and b.", ROWS[0]["answer"], {})]
    assert_run_settings(SFTValidator(cfg, load_tokenizer(tiny_model_dir), records, "code").reward_fn)


def test_train_and_eval_reward_runner_use_the_run_sandbox(sandbox):
    cfg = build_config(overrides=["reward.function=code", *SETTINGS])
    with build_reward_runner(cfg, "data_source_code") as runner:
        assert_run_settings(runner.fn)
