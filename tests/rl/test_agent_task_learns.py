"""The built-in multi-turn task guess_number learns: SFT warm start on demonstrations, then GRPO in the
environment raises the success (the full runs and their curve: benchmarks/agent_tasks.py, docs/agents.md "Built-in
tasks").

Both tests run the benchmark's recipe in-process from the untrained ``builtin:base`` model: demonstrations that
guess at random inside the interval the hints leave (``--rate 1.0``), SFT, then GRPO at lr 1e-3 with
``seq-mean-token-mean``. The slow test is the benchmark's run: the held-out success over 256 games rises by 15
points or more. That takes about 50 GRPO steps, too long for CI; the CI test plays one game (target 6) in every row,
where the first guess alone decides much of the reward, and checks that a few steps raise its success.
"""

import json

import pytest

from posttrain.agents.demos import demonstrations, write_jsonl
from posttrain.config.load import build_config
from posttrain.data.tasks import load_task
from posttrain.rl.train_command import run_training
from tests.helpers import read_metrics, sft_warm_start

SEED = 1
SFT_STEPS = 60
LENGTHS = ["data.max_prompt_length=96", "data.max_response_length=64"]
GRPO = [  # benchmarks/agent_tasks.py: COMMON_GRPO and GRPO["guess_number"]
    "data.task=guess_number",
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=16",
    "rollout.n=8",
    "rollout.multi_turn.max_assistant_turns=3",
    "rollout.multi_turn.max_tokens_per_turn=4",
    "actor.ppo_mini_batch_size=8",
    "actor.ppo_micro_batch_size_per_gpu=32",
    "actor.optim.lr=1e-3",
    "actor.optim.warmup_steps=5",
    "actor.loss_agg_mode=seq-mean-token-mean",
    "rollout.val_greedy=false",
    "trainer.loggers=[jsonl]",
]


def warm_start(tmp_path, steps=SFT_STEPS):
    """The SFT model of the benchmark's warm start (60 steps: about 45 s on one idle CPU thread)."""
    train, _ = load_task("guess_number", SEED, n_train=480, n_val=128)
    demos = write_jsonl(
        demonstrations("guess_number", train, steps * 32, SEED, 1.0), tmp_path / "demos.jsonl"
    )
    return sft_warm_start(tmp_path / "sft", demos, steps, SEED, *LENGTHS)


def held_out_curve(model, run_dir, steps, test_freq, n_val, *extra):
    """GRPO from ``model``; the held-out success at step 0 and every ``test_freq`` steps."""
    cfg = build_config(
        overrides=[
            *GRPO,
            *LENGTHS,
            *extra,
            f"model.path={model}",
            f"data.num_val_examples={n_val}",
            f"trainer.total_steps={steps}",
            f"trainer.test_freq={test_freq}",
            f"trainer.seed={SEED}",
            f"trainer.run_dir={run_dir}",
        ]
    )
    run_training(cfg, quiet=True)
    return [row["val/accuracy"] for row in read_metrics(run_dir) if "val/accuracy" in row]


def one_game_file(path, target, rows):
    """``rows`` copies of the default game with the same target (the row's fields go to the environment)."""
    train, _ = load_task("guess_number", SEED, n_train=1, n_val=0)
    game = {"prompt": train[0].prompt, "answer": str(target), **train[0].extra, "target": target}
    path.write_text((json.dumps(game) + "\n") * rows)
    return path


@pytest.mark.long
def test_a_few_grpo_steps_raise_the_success_of_one_game(tmp_path):
    game = one_game_file(tmp_path / "game.jsonl", target=6, rows=64)
    files = [f"data.train_files=[{game}]", f"data.val_files=[{game}]", "reward.function=environment"]
    curve = held_out_curve(warm_start(tmp_path, steps=40), tmp_path / "grpo", 8, 8, 64, *files)
    assert curve[-1] >= curve[0] + 0.2, curve


@pytest.mark.benchmark
def test_grpo_raises_the_held_out_success_by_15_points(tmp_path):
    curve = held_out_curve(warm_start(tmp_path), tmp_path / "grpo", steps=80, test_freq=10, n_val=256)
    assert max(curve[-3:]) >= curve[0] + 0.15, curve
