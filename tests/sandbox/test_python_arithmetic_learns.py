"""The built-in task python_arithmetic learns: SFT warm start on demonstrations that call the python tool, then
GRPO with the tool running in the real sandbox raises the held-out success (the full run and its curve:
benchmarks/agent_tasks.py python_arithmetic, docs/sandbox.md "The built-in task python_arithmetic").

The recipe is the calculator's (tests/rl/test_calculator_learns.py) with the python tool: products of two 2-digit
numbers (``data.task_options``), 300 SFT steps of 32 demonstrations of which half answer from memory with a wrong
number, then GRPO at lr 2e-4 with ``seq-mean-token-mean``. The prompt carries the task's instruction, hence
``data.max_prompt_length=96``. The warm start alone takes about 7 minutes on one CPU thread: a benchmark test only.
"""

import pytest

from posttrain.agents.demos import demonstrations, write_jsonl
from posttrain.config.load import build_config
from posttrain.data.tasks import load_task
from posttrain.rl.train_command import run_training
from tests.helpers import read_metrics, sft_warm_start

SEED = 1
SFT_STEPS = 300
N_TRAIN = 4000
OPTIONS = {"min_digits": 2, "max_digits": 2}
LENGTHS = ["data.max_prompt_length=96", "data.max_response_length=192"]
GRPO = [  # benchmarks/agent_tasks.py: COMMON_GRPO and GRPO["python_arithmetic"]
    "data.task=python_arithmetic",
    *[f"data.task_options.{name}={value}" for name, value in OPTIONS.items()],
    f"data.num_train_examples={N_TRAIN}",
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=16",
    "rollout.n=8",
    "rollout.multi_turn.max_assistant_turns=3",
    "rollout.multi_turn.max_tokens_per_turn=96",
    "actor.ppo_mini_batch_size=8",
    "actor.ppo_micro_batch_size_per_gpu=32",
    "actor.optim.lr=2e-4",
    "actor.optim.warmup_steps=5",
    "actor.loss_agg_mode=seq-mean-token-mean",
    "rollout.val_greedy=false",
    "env.kwargs={show_schemas: false}",
    "trainer.loggers=[jsonl]",
]


def warm_start(tmp_path):
    """The SFT model of the benchmark's warm start."""
    train, _ = load_task("python_arithmetic", SEED, n_train=N_TRAIN, n_val=128, **OPTIONS)
    rows = demonstrations("python_arithmetic", train, SFT_STEPS * 32, SEED)
    demos = write_jsonl(rows, tmp_path / "demos.jsonl")
    schedule = ["sft.optim.warmup_steps=10", "sft.optim.lr_schedule=cosine", "sft.optim.min_lr_ratio=0.1"]
    return sft_warm_start(tmp_path / "sft", demos, SFT_STEPS, SEED, *LENGTHS, *schedule)


@pytest.mark.benchmark
def test_grpo_raises_the_held_out_python_arithmetic_success_by_15_points(sandbox, tmp_path):
    cfg = build_config(
        overrides=[
            *GRPO,
            *LENGTHS,
            f"model.path={warm_start(tmp_path)}",
            "data.num_val_examples=128",
            "trainer.total_steps=40",
            "trainer.test_freq=10",
            f"trainer.seed={SEED}",
            f"trainer.run_dir={tmp_path / 'grpo'}",
        ]
    )
    run_training(cfg, quiet=True)
    curve = [row["val/accuracy"] for row in read_metrics(tmp_path / "grpo") if "val/accuracy" in row]
    assert max(curve[-2:]) >= curve[0] + 0.15, curve
