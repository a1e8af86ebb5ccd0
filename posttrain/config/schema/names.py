"""The names the schema offers as choices, taken from the algorithms' name tables (never copied here)."""

from __future__ import annotations

from posttrain.algorithms.names import ESTIMATOR_NEEDS, POLICY_LOSS_NAMES
from posttrain.algorithms.names import KL_ESTIMATORS as KL_ESTIMATOR_NAMES
from posttrain.algorithms.names import LOSS_AGG_MODES as AGG_MODES

# The algorithm names come from their torch-free table (posttrain.algorithms.names), never from a copy here.
ADV_ESTIMATORS = tuple(ESTIMATOR_NEEDS)
POLICY_LOSSES = POLICY_LOSS_NAMES
LOSS_AGG_MODES = tuple(AGG_MODES)
KL_ESTIMATORS = tuple(KL_ESTIMATOR_NAMES)
DTYPES = ("fp32", "bf16", "fp16")

# The built-in multi-turn tasks and the environment (`env.path`) each is played in: posttrain.data.tasks'
# Task.environment, which tests/agents/test_build.py keeps equal to this map (config cannot import data).
TASK_ENVIRONMENTS = {
    "calculator": "calculator",
    "guess_number": "guess_number",
    "python_arithmetic": "python",
}
BUILTIN_TASKS = ("arithmetic", "gsm8k", *TASK_ENVIRONMENTS)
# The built-in environments whose tools' schemas stay out of the prompt unless rollout.multi_turn.render_tools is
# set: their warm starts (demonstrations without the block) learn the call format, and the block is over 500 tokens
# of the tiny tokenizer, ten times the rest of a trajectory.
SCHEMAS_HIDDEN_BY_DEFAULT = ("calculator",)
