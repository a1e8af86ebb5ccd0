"""Every doc's first command block runs as written, on a fresh clone, in a fresh directory.

A doc's first command block is its first fenced block whose first line is a command (``posttrain``, ``python``,
``mkdir`` ...). Each page of docs/ is listed in :data:`QUICKSTARTS`: how its block is run (shortened only by
keys or flags the docs document, e.g. ``rm.max_steps=2``), or why it is not run here (a page without a command
block, a block for 8 GPUs, a usage synopsis). A new page must be added, so a
quick-start cannot rot unnoticed. The block runs with bash in a temporary directory where ``examples/`` and
``benchmarks/`` are the clone's (the commands a doc runs "from the root of your clone"), with ``posttrain``,
``python`` and ``python3`` this interpreter; ``pip install`` lines are skipped (the extras are installed here).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
COMMAND = re.compile(r"^(\$ )?(posttrain|python3?|pip|torchrun|mkdir|cd|bash)\b")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


@dataclass
class Quickstart:
    """How a doc's first command block runs: text replacements that shorten it (each must be found), slow."""

    shorten: list[tuple[str, str]] = field(default_factory=list)
    slow: bool = False
    block: str = "first"  # or a text the runnable block contains, when the first is another tool's command


# The default job (builtin:tiny, the arithmetic task) needs builtin:tiny's warm start, which the test's private model
# cache (tests/conftest.py) builds first: about 3 CPU-minutes on two threads, 13 on one. These entries run in
# test_default_job_quickstart_runs, on two threads outside pytest-xdist, so that in CI, in the session of
# tests/rl/test_learning.py (which builds the two-thread warm start), they find it built (.ci/run).
ONE_STEP = ("posttrain train ", "posttrain train trainer.total_steps=1 ")
DEFAULT_JOB = {
    "algorithms.md": Quickstart([ONE_STEP]),
    "async.md": Quickstart([ONE_STEP]),
    "distillation.md": Quickstart([ONE_STEP]),
    "lora.md": Quickstart([ONE_STEP]),
}
QUICKSTARTS: dict[str, Quickstart | str] = {
    "agents.md": "no command block (a reference page; the calculator's commands are in results/agents.md)",
    "architecture.md": "no command block",
    "config.md": "no command block (generated reference)",
    "rollout.md": "no command block",
    "throughput.md": "no command block",
    **DEFAULT_JOB,
    "judges.md": "a synopsis (`posttrain train ...` with the judge keys) that needs a judge endpoint; the endpoint is tested in tests/rewards/test_judge_endpoint.py",
    "batch-plan.md": Quickstart(),
    "distributed.md": "a torchrun launch on 8 GPUs (trainer.device=cuda) with the user's own my.yaml",
    "gateway.md": "a usage synopsis of posttrain serve (MODEL_DIR and options), not a command",
    "harnesses.md": "a fragment of the calculator recipe (it ends in '...'); its runnable form is "
    "benchmarks/agent_tasks.py calculator --harness (docs/results/gateway.md)",
    "migrating-from-verl.md": Quickstart(
        [("trainer.total_training_steps=4", "trainer.total_training_steps=1")],
        slow=True,
        block="make_verl_files.py",  # the first block is verl's own command, shown for comparison
    ),
    "performance.md": Quickstart([("bench_partition.py", "bench_partition.py --trials 1 --n 8")], slow=True),
    "reliability.md": "its first block is an error message the page explains, not a command",
    "reward-models.md": Quickstart([("rm.optim.lr=1e-5", "rm.optim.lr=1e-5 rm.max_steps=2")], slow=True),
    "sandbox.md": "an install command (pip install 'posttrain[sandbox]') only",
    "tuning.md": Quickstart(),
    "your-agent-task.md": Quickstart(),
    "your-task.md": Quickstart(),
}


def command_block(text: str, contains: str = "first") -> str | None:
    """The doc's first fenced block that starts with a command (or the first such block holding ``contains``)."""
    for match in FENCE.finditer(text):
        lines = [line for line in match.group(2).splitlines() if line.strip() and not line.startswith("#")]
        if lines and COMMAND.match(lines[0]) and (contains == "first" or contains in match.group(2)):
            return match.group(2)
    return None


def script(block: str) -> str:
    """The block as a bash script: a transcript keeps its ``$`` lines (and their continuations) only; pip lines
    are dropped."""
    lines, keep = [], True
    transcript = any(line.startswith("$ ") for line in block.splitlines())
    for line in block.splitlines():
        if transcript:
            if line.startswith("$ "):
                keep, line = True, line[2:]
            elif not (lines and lines[-1].endswith("\\")):
                keep = False
            if not keep:
                continue
        if line.startswith("pip install"):
            continue
        lines.append(line)
    return "set -e\n" + "\n".join(lines) + "\n"


def fresh_clone_dir(tmp_path: Path) -> Path:
    """A directory that is a stand-in for the root of a fresh clone: examples/ and benchmarks/ are the clone's,
    and nothing else is there."""
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    for name, target in (
        ("posttrain", f'"{sys.executable}" -m posttrain'),
        ("python", f'"{sys.executable}"'),
    ):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        (bin_dir / name).chmod(0o755)
    (bin_dir / "python3").symlink_to(bin_dir / "python")
    return bin_dir


def run_quickstart(doc: str, tmp_path: Path, threads: int = 1) -> str:
    entry = QUICKSTARTS[doc]
    assert isinstance(entry, Quickstart)
    block = command_block((DOCS / doc).read_text(), entry.block)
    assert block, f"docs/{doc} has no command block (holding {entry.block!r})"
    for old, new in entry.shorten:
        assert old in block, (
            f"docs/{doc}: the first command block no longer holds {old!r}: update QUICKSTARTS"
        )
        block = block.replace(old, new)  # every occurrence: each command of the block is shortened
    bin_dir = fresh_clone_dir(tmp_path)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": str(threads),
    }
    done = subprocess.run(
        ["bash", "-c", script(block)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"docs/{doc}:\n{script(block)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_every_doc_is_listed():
    docs = {p.name for p in DOCS.glob("*.md")}
    assert docs == set(QUICKSTARTS), (
        f"add to QUICKSTARTS: {sorted(docs - set(QUICKSTARTS))}; drop: {sorted(set(QUICKSTARTS) - docs)}"
    )
    for doc, entry in QUICKSTARTS.items():  # a page said to have no block must not have gained one
        if isinstance(entry, str) and entry.startswith("no command block"):
            assert command_block((DOCS / doc).read_text()) is None, f"docs/{doc} now has a command block"


FAST = [
    d for d, e in QUICKSTARTS.items() if isinstance(e, Quickstart) and not e.slow and d not in DEFAULT_JOB
]
SLOW = [d for d, e in QUICKSTARTS.items() if isinstance(e, Quickstart) and e.slow and d not in DEFAULT_JOB]


@pytest.mark.parametrize("doc", FAST)
def test_quickstart_runs(doc, tmp_path):
    run_quickstart(doc, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("doc", SLOW)
def test_slow_quickstart_runs(doc, tmp_path):
    run_quickstart(doc, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("doc", sorted(DEFAULT_JOB))
def test_default_job_quickstart_runs(doc, tmp_path):
    """Two threads (the two-thread warm start, the one tests/rl/test_learning.py builds), one under xdist."""
    run_quickstart(doc, tmp_path, threads=1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
