"""docs/your-agent-task.md: the tutorial's files load and play, and its recipe raises the held-out success.

The tests run the tutorial's tool, tool config and reward through posttrain's own loaders, a scripted call through
the agent loop, and (slow) the tutorial's SFT and GRPO commands as documented, asserting the rise of the
validation success that docs/your-agent-task.md ("7. GRPO") reports."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.agents.build import environment_factory
from posttrain.agents.driver import MultiTurnSettings, run_trajectories
from posttrain.agents.hermes import tool_call_text
from posttrain.config.load import build_config
from posttrain.rewards.functions import resolve_reward_function
from tests.helpers import read_metrics, scripted

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "your_agent_task"
FILES = ("make_data.py", "weather.py", "tools.yaml", "reward.py")
MT = (
    "data.train_files=[data/train.jsonl] data.val_files=[data/val.jsonl] data.answer_key='' "
    "reward.function=reward.py:reward rollout.multi_turn.enable=true rollout.multi_turn.tool_config_path=tools.yaml "
    "rollout.multi_turn.render_tools=false rollout.multi_turn.max_assistant_turns=2 data.max_prompt_length=32 "
    "data.max_response_length=128 rollout.val_greedy=false rollout.temperature=0.7"
)
SFT = (
    "posttrain sft model.path=builtin:base sft.train_files=[data/demos.jsonl] data.prompt_key=messages "
    "sft.response_key='' data.max_prompt_length=32 data.max_response_length=128 sft.batch_size=16 "
    "sft.micro_batch_size_per_gpu=16 sft.epochs=2 sft.optim.lr=1e-3 sft.optim.warmup_steps=5 trainer.test_freq=0 "
    "trainer.run_dir=runs/sft"
)
EVAL = "posttrain eval --model runs/sft/sft_model " + MT + " trainer.run_dir=runs/sft"
GRPO = (
    "posttrain train model.path=runs/sft/sft_model "
    + MT
    + " algorithm.adv_estimator=grpo data.train_batch_size=8 "
    "rollout.n=8 actor.ppo_mini_batch_size=4 actor.ppo_micro_batch_size_per_gpu=32 actor.optim.lr=2e-4 actor.loss_agg_mode=seq-mean-token-mean "
    "trainer.total_steps=4 trainer.test_freq=2 trainer.run_dir=runs/grpo"
)
COMMANDS = ["python3 make_data.py data", SFT, EVAL, GRPO]
STEPS = 4  # the GRPO command's trainer.total_steps
RISE = 0.15  # the least rise asserted; measured: see docs/your-agent-task.md, "7. GRPO"


@pytest.fixture
def tutorial(tmp_path, monkeypatch):
    """A directory with the tutorial's files and data, as its first two commands leave it."""
    for name in FILES:
        shutil.copy(EXAMPLE / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    run(COMMANDS[0], tmp_path)
    return tmp_path


def run(line: str, cwd: Path) -> str:
    """A documented command line, run by bash (for its quoting) with this interpreter as posttrain/python3."""
    program, _, rest = line.partition(" ")
    line = {"posttrain": f"{sys.executable} -m posttrain", "python3": sys.executable}[program] + " " + rest
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        ["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_commands_are_the_documented_ones():
    doc = " ".join((ROOT / "docs" / "your-agent-task.md").read_text().replace("\\\n", " ").split())
    for line in COMMANDS:
        assert line in doc, line


def overrides(text: str) -> list[str]:
    return [word.replace("''", "") for word in text.split()]


def test_the_files_load_and_a_call_is_rewarded(tutorial, tok):
    rows = [json.loads(line) for line in (tutorial / "data" / "val.jsonl").read_text().splitlines()]
    demos = [json.loads(line) for line in (tutorial / "data" / "demos.jsonl").read_text().splitlines()]
    assert len(rows) == 64 and len(demos) == 960
    cfg = build_config(overrides=overrides(MT))
    reward = resolve_reward_function(cfg.reward.function)

    def policy(conversation: str) -> str:  # calls the tool, then repeats its report
        if "<tool_response>" not in conversation:
            return tool_call_text("weather", {"city": "Oslo"})
        return conversation.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0]

    settings = MultiTurnSettings(cfg.rollout.multi_turn, cfg.data.max_response_length)
    (traj,) = run_trajectories(rows[:1], environment_factory(cfg), scripted(tok, policy), tok, settings)
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert traj.messages[2]["content"] in ("sunny", "rainy", "cloudy", "windy")
    assert traj.tools is None  # render_tools=false: the prompt has no schema block
    assert reward(rows[0]["prompt"], "", "", {"messages": traj.messages}) == 1.0
    guessed = traj.messages[:1] + [{"role": "assistant", "content": traj.messages[2]["content"]}]
    # right or not, an answer without the tool's report earns nothing
    assert reward(rows[0]["prompt"], "", "", {"messages": guessed}) == 0.0
    elsewhere = [{"role": "user", "content": "Weather in Rome?"}, *traj.messages[1:]]
    # the report of a call about another city (Oslo) is no answer to this question
    assert reward("Weather in Rome?", "", "", {"messages": elsewhere}) == 0.0


@pytest.mark.slow
def test_the_recipe_raises_the_held_out_success(tutorial):
    """SFT from builtin:base, then GRPO, both as documented: the sampled success on the 64 validation questions
    rises by RISE or more from the warm start to the last step (measured: see docs/your-agent-task.md)."""
    run(SFT, tutorial)
    run(GRPO, tutorial)
    vals = [m for m in read_metrics(tutorial / "runs" / "grpo") if "val/accuracy" in m]
    first, last = vals[0]["val/accuracy"], vals[-1]["val/accuracy"]
    assert (vals[0]["step"], vals[-1]["step"]) == (0, STEPS)
    assert last - first >= RISE, f"validation success {first:.3f} -> {last:.3f}"
