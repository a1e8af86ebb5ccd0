"""The built-in agentic tasks learn: SFT warm start on demonstrations, then GRPO raises the held-out success.

The same commands as benchmarks/agent_tasks.py (and docs/agents.md, "Built-in tasks"), run as subprocesses.
Slow (tens of minutes on a loaded 2-core CPU): CI runs it with ``-m slow``.
"""

import argparse
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import agent_tasks  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("task", ["guess_number", "calculator"])
def test_grpo_raises_held_out_success_over_the_warm_start(task, tmp_path):
    args = argparse.Namespace(sft_steps=100, grpo_steps=30, test_freq=10, seed=1)
    for name, cmd in agent_tasks.commands(task, tmp_path, args):
        agent_tasks.run(cmd, tmp_path / f"{name}.log")
    points = agent_tasks.curve(tmp_path / "grpo" / "metrics.jsonl")
    warm, best = points[0]["success"], max(p["success"] for p in points[1:])
    assert best >= warm + 0.15, json.dumps(points)
