"""Drill: a resumed run appended a second record for every step it redid (metrics.jsonl, samples.jsonl: 256
validation rows for step 3 instead of 128; read_metrics merged them, other readers did not). The records of the
steps after the checkpoint a run resumes from are dropped before it redoes them: every step is written once,
read here line by line, not through read_metrics."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.train import loop
from tests.helpers import rm_cli_args, sft_cli_args, small_overrides


class Killed(Exception):
    """Stands for a kill at the start of a step (after the previous step was logged, before a checkpoint)."""


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _args(command: str, run: Path, model_dir: Path) -> list[str]:
    """4 steps, a checkpoint every 2, a validation every step."""
    if command == "rm":
        return rm_cli_args(run, model_dir, "trainer.test_freq=1")
    if command == "sft":
        val = run.parent / "sft_val.jsonl"
        val.write_text(
            "\n".join(json.dumps({"prompt": f"{i} + 2?", "response": str(i + 2)}) for i in range(3))
        )
        return [
            *sft_cli_args(run, model_dir, rows=16),
            f"sft.val_files=[{val}]",
            "reward.function=exact_match",
            "data.max_response_length=4",
            "trainer.save_freq=2",
            "trainer.test_freq=1",
        ]
    return small_overrides(
        model_dir, run, "trainer.total_steps=4", "trainer.save_freq=2", "trainer.test_freq=1"
    )


@pytest.mark.parametrize("command", ["train", "rm", "sft"])
def test_a_resumed_run_writes_each_steps_records_once(command, tiny_model_dir, tmp_path, monkeypatch):
    run = tmp_path / "run"
    args = _args(command, run, tiny_model_dir)

    def killed_at_4(step: int, rank: int) -> None:
        if step == 4:
            raise Killed

    monkeypatch.setattr(loop, "crash_if_asked", killed_at_4)
    with pytest.raises(Killed):
        main([command, *args])
    assert _steps(run / "metrics.jsonl") == [0, 1, 2, 3]  # step 3 logged, its checkpoint never written
    monkeypatch.undo()
    assert main([command, *args]) == 0  # resumes from step 2: redoes 3
    assert _steps(run / "metrics.jsonl") == [0, 1, 2, 3, 4]
    if command != "rm":  # rm writes no samples
        per_step = Counter(_steps(run / "samples.jsonl"))
        assert sorted(per_step) == [0, 1, 2, 3, 4] and len(set(per_step.values())) == 1, per_step
