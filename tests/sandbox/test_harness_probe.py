"""The sandbox check at start-up runs the code reward's own harness at the configured limits.

Drill (before): at sandbox.memory_limit_mb=16, the smallest value the schema accepts, the code reward scored
every correct program 0 (reward/code/memory_limits 24 of 24) while explain's probe (a bare `print(6 * 7)`)
passed. With sandbox.time_limit_s=0.1 the probe's verdict depended on the machine's load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.config.errors import ConfigError
from posttrain.config.schema.sandbox import SandboxConfig
from posttrain.planning.sandbox_probe import (
    PROBE_TIME_S,
    check_code_sandbox,
    harness_probe_line,
    run_harness_probe,
)
from posttrain.rewards.code import CodeReward
from posttrain.sandbox.build import build_sandbox
from posttrain.sandbox.types import RunRequest

CODE_DATA = Path(__file__).parents[2] / "examples/code/tiny_code.jsonl"
SUM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
CASES = json.dumps({"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7\n"]})


def test_the_harness_probe_fails_where_the_code_reward_fails(sandbox):
    tight = SandboxConfig(memory_limit_mb=16)
    bare = build_sandbox(tight).run(RunRequest("print(6 * 7)"))
    assert bare.stdout == "42\n"  # a bare program runs: it is not what the reward runs
    assert CodeReward(build_sandbox(tight))("p", SUM, CASES, {}) == 0.0  # a correct program scores 0
    with pytest.raises(ConfigError) as info:
        check_code_sandbox(tight)
    message = str(info.value)
    assert "sandbox.memory_limit_mb=16 is too small" in message
    works = int(message.split("set sandbox.memory_limit_mb=")[1].split()[0])
    assert 16 < works <= 32 and works % 8 == 0 and run_harness_probe(tight, works).passed
    assert CodeReward(build_sandbox(SandboxConfig(memory_limit_mb=works)))("p", SUM, CASES, {}) == 1.0


@pytest.mark.parametrize("command", ["explain", "train"])
def test_a_memory_limit_too_small_for_the_harness_stops_before_any_model_loads(sandbox, command, capsys):
    """16 MiB, the old minimum, is refused when the config loads (measured: the harness needs 19 to 24 MiB
    here); a larger one the harness cannot run under elsewhere is refused by the probe above."""
    args = [
        command,
        "reward.function=code",
        f"data.train_files=[{CODE_DATA}]",
        "model.path=/nonexistent/never/loaded",
        "sandbox.memory_limit_mb=16",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "'sandbox.memory_limit_mb' = 16 must be >= 32" in err
    assert main([*args[:-1], "sandbox.memory_limit_mb=32"]) == 2  # accepted: the next check fails
    assert "model.path='/nonexistent/never/loaded'" in capsys.readouterr().err


def test_the_probe_judges_time_apart_so_its_verdict_does_not_depend_on_load(sandbox):
    fast = SandboxConfig(time_limit_s=0.1)
    probe = check_code_sandbox(fast)  # passes however loaded the machine is, up to PROBE_TIME_S
    assert probe.passed and probe.duration_s < PROBE_TIME_S
    line = harness_probe_line(fast)
    assert "probe: print(6 * 7) -> 42 in" in line and "time judged apart" in line
