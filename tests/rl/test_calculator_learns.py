"""The built-in tool task calculator learns: SFT warm start on tool-using demonstrations, then GRPO in the
calculator environment raises the success (the full run and its curve: benchmarks/agent_tasks.py calculator,
docs/agents.md "Built-in tasks").

The slow test is the benchmark's recipe: products of two 2-digit numbers (the task's default), 500 SFT steps of 32
demonstrations of which half answer from memory with a wrong number, then GRPO at lr 2e-4 with
``seq-mean-token-mean``; the held-out success rises by 15 points or more. Its warm start alone takes about 12 minutes
on one CPU thread: copying the question's operands into the tool call takes the tiny model hundreds of steps (after
40 or 80 steps it copies neither them nor the tool's result).

The short test therefore plays one problem in every row, as guess_number's CI test plays one game: 40 SFT steps teach
the call for it, sampling at temperature 0.5 makes that 69-token call come out whole, and a few GRPO steps make the
model call the tool, read the result and answer with it instead of answering from memory. It checks the rise of
the success and that the calls carry it (the tool-call rate), so a policy that learned the product by heart and
answered without the tool would fail it. It takes 8 to 10 minutes of one CPU thread (2-core AMD EPYC, AVX2), and
python_arithmetic's short test (tests/sandbox/test_python_arithmetic_learns.py) runs the same recipe with the
tool in the sandbox in CI, so this one is a benchmark test (``-m benchmark``), not a CI one.
"""

import pytest

from posttrain.agents.demos import demonstrations, write_jsonl
from posttrain.data.tasks import load_task
from tests.helpers import (
    HELD_OUT_GRPO,
    one_problem_file,
    one_problem_grpo,
    one_problem_warm_start,
    sft_warm_start,
    tool_task_curve,
)

SEED = 1
SFT_STEPS = 500  # 300 copied the tool's result on one CPU kind only (docs/results/agents.md)
N_TRAIN = 4000
LENGTHS = ["data.max_prompt_length=64", "data.max_response_length=192"]
COSINE = ["sft.optim.warmup_steps=10", "sft.optim.lr_schedule=cosine", "sft.optim.min_lr_ratio=0.1"]


def warm_start(tmp_path, train, steps, *schedule):
    """SFT of ``builtin:base`` on ``steps`` x 32 demonstrations of ``train`` (half of them answer from memory)."""
    demos = write_jsonl(demonstrations("calculator", train, steps * 32, SEED), tmp_path / "demos.jsonl")
    return sft_warm_start(tmp_path / "sft", demos, steps, SEED, *LENGTHS, *schedule)


def grpo_curve(model, run_dir, *extra):
    """GRPO from ``model`` (the benchmark's settings); the success and tool-call rate of each validation."""
    return tool_task_curve("calculator", model, run_dir, SEED, *LENGTHS, *extra)


@pytest.mark.benchmark  # python_arithmetic's short test is this recipe in CI
def test_a_few_grpo_steps_make_the_model_answer_one_problem_with_the_tool(tmp_path):
    (record,), _ = load_task("calculator", SEED, n_train=1, n_val=0)
    model = one_problem_warm_start(tmp_path, "calculator", record, SEED, *LENGTHS)
    rows = one_problem_file(record, tmp_path / "problem.jsonl")
    curve = grpo_curve(model, tmp_path / "grpo", *one_problem_grpo(rows, "calculator"))
    (success_before, calls_before), (success_after, calls_after) = curve[0], curve[-1]
    assert success_after >= success_before + 0.2, curve
    assert calls_after >= 0.9 > calls_before, curve


@pytest.mark.benchmark
def test_grpo_raises_the_held_out_calculator_success_by_15_points(tmp_path):
    train, _ = load_task("calculator", SEED, n_train=N_TRAIN, n_val=128)
    curve = grpo_curve(
        warm_start(tmp_path, train, SFT_STEPS, *COSINE),
        tmp_path / "grpo",
        f"data.num_train_examples={N_TRAIN}",
        *HELD_OUT_GRPO,
    )
    successes = [success for success, _ in curve]
    assert max(successes[-2:]) >= successes[0] + 0.15, successes
