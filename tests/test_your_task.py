"""docs/your-task.md, run as written (at its own small size, on CPU): data files, a reward file, SFT from
builtin:base, eval, GRPO. Accuracy on held-out words must rise after SFT and again after RL, on any x86 CPU
(the recipe was checked on an Intel Xeon with torch's AVX-512, AVX2 and plain kernels)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = "data.train_files=[data/train.jsonl] data.val_files=[data/val.jsonl] reward.function=reward.py:reward"
COMMANDS = [
    "python3 make_data.py data",
    "posttrain eval model.path=builtin:base "
    + DATA
    + " data.max_response_length=6 trainer.run_dir=runs/base",
    "posttrain sft model.path=builtin:base sft.train_files=[data/train.jsonl] sft.response_key=answer "
    "data.val_files=[data/val.jsonl] reward.function=reward.py:reward data.max_response_length=6 "
    "sft.batch_size=16 sft.micro_batch_size_per_gpu=16 sft.epochs=2 sft.optim.lr=1e-3 sft.optim.warmup_steps=20 "
    "trainer.test_freq=50 trainer.run_dir=runs/sft",
    "posttrain eval --model runs/sft/sft_model "
    + DATA
    + " data.max_response_length=6 trainer.run_dir=runs/sft",
    "posttrain train model.path=runs/sft/sft_model " + DATA + " data.max_response_length=6 "
    "data.train_batch_size=16 actor.ppo_mini_batch_size=8 trainer.total_steps=10 trainer.run_dir=runs/grpo",
]


def run(line: str, cwd: Path) -> str:
    words = line.split()
    if words[0] == "posttrain":
        words = [sys.executable, "-m", "posttrain", *words[1:]]
    elif words[0] == "python3":
        words[0] = sys.executable
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(words, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def accuracy(out: str) -> float:
    return float(next(line for line in out.splitlines() if line.startswith("val/accuracy:")).split()[1])


def test_commands_are_the_documented_ones():
    doc = (ROOT / "docs" / "your-task.md").read_text()
    for line in COMMANDS:
        assert line in " ".join(doc.replace("\\\n", " ").split()), line


@pytest.mark.slow
def test_your_task_tutorial_learns(tmp_path):
    for name in ("make_data.py", "reward.py"):
        shutil.copy(ROOT / "examples" / "your_task" / name, tmp_path / name)
    run(COMMANDS[0], tmp_path)
    assert len((tmp_path / "data" / "train.jsonl").read_text().splitlines()) == 400
    before = accuracy(run(COMMANDS[1], tmp_path))
    run(COMMANDS[2], tmp_path)
    after_sft = accuracy(run(COMMANDS[3], tmp_path))
    rl = run(COMMANDS[4], tmp_path)
    final = [json.loads(x) for x in (tmp_path / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()]
    after_rl = [m["val/accuracy"] for m in final if "val/accuracy" in m][-1]
    assert before < 0.05 and after_sft > before + 0.3, (before, after_sft)
    # RL must add 5 points, or remove half the errors SFT left when fewer than 10% are left: SFT ended at
    # 75.0% on an Intel Xeon with its AVX-512 kernels and its plain ones, 89.3% with trainer.seed=2.
    assert after_rl >= after_sft + min(0.05, (1 - after_sft) / 2) and after_rl > after_sft, (
        after_sft,
        after_rl,
        rl[-2000:],
    )
    assert (tmp_path / "runs" / "grpo" / "samples.jsonl").exists()
