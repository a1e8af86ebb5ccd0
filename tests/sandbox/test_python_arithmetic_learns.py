"""The built-in task python_arithmetic learns: SFT warm start on demonstrations that call the python tool, then
GRPO with the tool running in the real sandbox raises the success (the full run and its curve:
benchmarks/agent_tasks.py python_arithmetic, docs/sandbox.md "The built-in task python_arithmetic").

The benchmark test is the calculator's recipe (tests/rl/test_calculator_learns.py) with the python tool: products
of two 2-digit numbers (``data.task_options``), 300 SFT steps of 32 demonstrations of which half answer from memory
with a wrong number, then GRPO at lr 2e-4 with ``seq-mean-token-mean``. The prompt carries the task's instruction,
hence ``data.max_prompt_length=96``. The warm start alone takes about 7 minutes on one CPU thread: a benchmark test
only.

The short test (``-m slow``, as the calculator's) plays one problem in every row: 40 SFT steps teach the python
call for it, and a few GRPO steps, whose rollouts run the model's ``print(a * b)`` in the sandbox, make the model
call the tool and answer with its output. It checks the rise of the success, that the calls carry it (the
tool-call rate: a policy that learned the product by heart and answered without the tool fails it) and that the
answers are the product the sandbox printed.
"""

import json

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
SFT_STEPS = 300
N_TRAIN = 4000
OPTIONS = {"min_digits": 2, "max_digits": 2}
LENGTHS = ["data.max_prompt_length=96", "data.max_response_length=192"]
# The python tool's schema block (500 tokens) stays out of the prompt, as in the demonstrations.
GRPO = ["rollout.multi_turn.render_tools=false"]


def warm_start(tmp_path):
    """The SFT model of the benchmark's warm start."""
    train, _ = load_task("python_arithmetic", SEED, n_train=N_TRAIN, n_val=128, **OPTIONS)
    rows = demonstrations("python_arithmetic", train, SFT_STEPS * 32, SEED)
    demos = write_jsonl(rows, tmp_path / "demos.jsonl")
    schedule = ["sft.optim.warmup_steps=10", "sft.optim.lr_schedule=cosine", "sft.optim.min_lr_ratio=0.1"]
    return sft_warm_start(tmp_path / "sft", demos, SFT_STEPS, SEED, *LENGTHS, *schedule)


def answered_with_the_printed_product(run_dir, step: int) -> float:
    """The share of the validation trajectories at ``step`` whose tool message is the product (the sandbox ran
    the model's code and it printed the product) and whose answer is that product."""
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    rows = [row for row in rows if row["step"] == step]
    printed = [[m["content"].strip() for m in row["messages"] if m["role"] == "tool"] for row in rows]
    right = [row["ground_truth"] in out and row["reward"] == 1.0 for row, out in zip(rows, printed)]
    return sum(right) / len(rows)


def grpo_curve(model, run_dir, *extra):
    """GRPO from ``model`` (the benchmark's settings); the success and tool-call rate of each validation."""
    return tool_task_curve("python_arithmetic", model, run_dir, SEED, *GRPO, *LENGTHS, *extra)


@pytest.mark.slow  # 8 to 10 minutes of one CPU thread: over the budget of a test in the plain suite
def test_a_few_grpo_steps_make_the_model_answer_one_problem_with_the_sandboxed_python_tool(sandbox, tmp_path):
    (record,), _ = load_task("python_arithmetic", SEED, n_train=1, n_val=0, **OPTIONS)
    # 60% of the demonstrations without the tool, not the calculator's half: from half, the warm start already
    # called the tool in 69% and was right in 69% of its answers, which left GRPO 31 points to rise (it rose 19
    # in 8 steps). From 75% it called in 3% and GRPO learned to answer 660 from memory (the call-rate check fails).
    model = one_problem_warm_start(tmp_path, "python_arithmetic", record, SEED, *LENGTHS, no_tool_rate=0.6)
    rows = one_problem_file(record, tmp_path / "problem.jsonl")
    curve = grpo_curve(model, tmp_path / "grpo", *one_problem_grpo(rows, "arithmetic"))
    (success_before, calls_before), (success_after, calls_after) = curve[0], curve[-1]
    assert success_after >= success_before + 0.2, curve
    assert calls_after >= 0.9 > calls_before, curve
    assert answered_with_the_printed_product(tmp_path / "grpo", 8) >= 0.8, curve


@pytest.mark.benchmark
def test_grpo_raises_the_held_out_python_arithmetic_success_by_15_points(sandbox, tmp_path):
    curve = grpo_curve(
        warm_start(tmp_path),
        tmp_path / "grpo",
        *[f"data.task_options.{name}={value}" for name, value in OPTIONS.items()],
        f"data.num_train_examples={N_TRAIN}",
        *HELD_OUT_GRPO,
    )
    successes = [success for success, _ in curve]
    assert max(successes[-2:]) >= successes[0] + 0.15, successes
