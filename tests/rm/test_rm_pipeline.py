"""The reward-model demonstration end to end, shortened (the full run: benchmarks/rm_demo.py): pairs from the
built-in arithmetic task -> `posttrain rm` from builtin:tiny -> GRPO with the reward model as the only reward,
whose true held-out accuracy (the rule, in validation only) rises. Builds the warm-started built-in model first,
so this takes minutes."""

import pytest

from posttrain.config.load import build_config
from posttrain.rl.train_command import run_training
from posttrain.rm.command import run_rm_command
from posttrain.rm.demo import write_task_pairs
from posttrain.utils.metrics import read_metrics

RM_STEPS = 100
GRPO_STEPS = 10


def val_rows(path):
    return [r for r in read_metrics(path) if "val/accuracy" in r]


@pytest.mark.slow
def test_grpo_on_the_reward_model_alone_raises_true_accuracy(tmp_path):
    train, val = write_task_pairs(tmp_path / "pairs", per_problem=4)
    rm = [
        "model.path=builtin:tiny", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.run_dir={tmp_path / 'rm'}", "rm.batch_size=32", "rm.micro_batch_size_per_gpu=32",
        "rm.optim.lr=3e-4", "rm.optim.weight_decay=0", "rm.optim.warmup_steps=10", "rm.optim.lr_schedule=constant",
        f"rm.max_steps={RM_STEPS}", "rm.epochs=100", f"trainer.test_freq={RM_STEPS}",
    ]  # fmt: skip
    exported = run_rm_command(build_config(overrides=rm), quiet=True)
    checks = val_rows(tmp_path / "rm" / "metrics.jsonl")
    first, last = checks[0], checks[-1]
    # Measured (one thread): 0.547 -> 0.689. The 90% of the issue is not reached (docs/reward-models.md).
    assert last["val/accuracy"] >= first["val/accuracy"] + 0.08, (first, last)

    grpo = [
        f"trainer.run_dir={tmp_path / 'grpo'}", "trainer.loggers=[jsonl]", f"trainer.total_steps={GRPO_STEPS}",
        f"trainer.test_freq={GRPO_STEPS}", "reward.model.enable=true", f"reward.model.path={exported}",
        "reward.rule_weight=0",
    ]  # fmt: skip
    run_training(build_config(overrides=grpo), quiet=True)
    rows = read_metrics(tmp_path / "grpo" / "metrics.jsonl")
    before, after = val_rows(tmp_path / "grpo" / "metrics.jsonl")[0], rows[-1]
    assert after["val/accuracy"] >= before["val/accuracy"] + 0.08, (before, after)  # measured 0.289 -> 0.539
    trained = [r for r in rows if "reward/mean" in r]  # step 0 holds the first validation only
    assert len(trained) == GRPO_STEPS
    assert all(r["reward/mean"] == pytest.approx(r["reward/model_score_mean"], abs=1e-5) for r in trained)
