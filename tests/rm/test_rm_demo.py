"""The demonstration's pairs, and a short `posttrain rm` run on them whose held-out accuracy clearly rises
(the full runs and their figures: benchmarks/rm_demo.py, docs/reward-models.md)."""

import json

import pytest

from posttrain.config.load import build_config
from posttrain.data.tasks.arithmetic import make_arithmetic_splits
from posttrain.rm.command import run_rm_command
from posttrain.rm.demo import arithmetic_pairs, write_arithmetic_pairs
from posttrain.utils.metrics import read_metrics


@pytest.mark.parametrize("kind", ["offset", "other", "refusal"])
def test_pairs_hold_a_right_and_a_wrong_answer(kind):
    train, _ = make_arithmetic_splits(1, 50, 0)
    for rec, row in zip(train, arithmetic_pairs(train, seed=0, kind=kind)):
        assert row["prompt"] == rec.prompt and row["chosen"] == rec.ground_truth
        assert row["rejected"] != row["chosen"]
        if kind == "offset":
            assert 0 < abs(int(row["rejected"]) - int(row["chosen"])) <= 5


def test_held_out_problems_are_not_trained_on(tmp_path):
    train, val = write_arithmetic_pairs(tmp_path, 40, 10, seed=2)
    prompts = [{json.loads(line)["prompt"] for line in f.read_text().splitlines()} for f in (train, val)]
    assert len(prompts[0]) == 40 and len(prompts[1]) == 10 and not prompts[0] & prompts[1]


def test_a_short_run_learns_to_rank_held_out_pairs(tmp_path, tiny_model_dir):
    train, val = write_arithmetic_pairs(tmp_path / "pairs", 160, 40, seed=1, kind="refusal")
    overrides = [
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        f"trainer.run_dir={tmp_path / 'run'}",
        "rm.batch_size=16",
        "rm.micro_batch_size_per_gpu=16",
        "rm.max_steps=8",
        "rm.optim.lr=1e-3",
        "trainer.test_freq=8",
    ]
    run_rm_command(build_config(overrides=overrides), quiet=True)
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "val/accuracy" in r]
    first, last = rows[0], rows[-1]
    assert first["step"] == 0 and last["step"] == 8
    assert last["val/accuracy"] >= 0.95
    assert last["val/margin"] > first["val/margin"] + 1.0
