"""Step metrics flow end to end: a tool's ``ToolOutput.metrics`` into its turn's ``StepResult.metrics``, every
step's into the trajectory (summed per key), and the trajectories' into ``env/<key>`` (a mean per trajectory)."""

import asyncio

import pytest

from posttrain.agents.driver import EnvironmentFailure, run_trajectories
from posttrain.agents.env import Environment, StepResult, ToolEnvironment
from posttrain.agents.hermes import tool_call_text
from posttrain.agents.tools import ToolOutput, ToolSet, make_tool
from posttrain.agents.trajectory import trajectory_metrics
from posttrain.config.errors import ConfigError
from tests.helpers import multi_turn_settings, scripted


def lookup(table: str) -> ToolOutput:
    """Look a table up.

    Args:
        table: the table's name.
    """
    return ToolOutput(text="3 rows", metrics={"rows_read": 3.0, "lookups": 1})


def test_a_tools_metrics_are_its_steps_summed_over_the_calls():
    env = ToolEnvironment(ToolSet([make_tool(lookup)]))
    two_calls = tool_call_text("lookup", {"table": "a"}) + tool_call_text("lookup", {"table": "b"})
    step = asyncio.run(env.step(two_calls + tool_call_text("nope", {})))  # a failed call reports nothing
    assert step.metrics == {"rows_read": 6.0, "lookups": 2.0}


class Counted(Environment):
    """Answers with a hint twice, then stops; each step reports the length of the turn it read."""

    def __init__(self) -> None:
        self.steps = 0

    def step(self, text: str) -> StepResult:
        self.steps += 1
        messages = [] if self.steps == 3 else [{"role": "user", "content": "again"}]
        return StepResult(messages=messages, done=self.steps == 3, metrics={"chars_read": float(len(text))})


def test_tool_and_step_metrics_reach_the_trajectory_and_env_keys(tok):
    """Per trajectory the steps' values are summed; over trajectories averaged (one that reported a key not at
    all counts 0)."""
    tools = ToolSet([make_tool(lookup)])

    def policy(conversation):
        if "prompt-tools" in conversation and "<tool_response>" not in conversation:
            return tool_call_text("lookup", {"table": "t"})
        return "abcd"

    def make_env(row):
        return ToolEnvironment(tools) if row["prompt"] == "prompt-tools" else Counted()

    rows = [{"prompt": "prompt-tools"}, {"prompt": "prompt-counted"}]
    with_tools, counted = run_trajectories(rows, make_env, scripted(tok, policy), tok, multi_turn_settings())
    assert with_tools.step_metrics == {"rows_read": 3.0, "lookups": 1.0}
    assert counted.step_metrics == {"chars_read": 12.0}  # three turns of "abcd"
    m = trajectory_metrics([with_tools, counted])
    assert m["env/rows_read"] == 1.5 and m["env/lookups"] == 0.5 and m["env/chars_read"] == 6.0
    assert "env/step_time_mean_s" in m


class Reports(Environment):
    def __init__(self, metrics) -> None:
        self.reported = metrics

    def step(self, text: str) -> StepResult:
        return StepResult(done=True, metrics=self.reported)


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        (
            {"score": "high"},
            r"Reports\.step on row 0 reported the metric 'score' = 'high': a metric is a real",
        ),
        (
            {"step_time_mean_s": 1.0},
            r"'step_time_mean_s' \(env/step_time_mean_s is the driver's own\); rename",
        ),
        ({3: 1.0}, r"reported the metric 3: metric names are strings"),
    ],
)
def test_a_bad_step_metric_is_refused_by_name(tok, metrics, message):
    with pytest.raises(ConfigError, match=message):
        run_trajectories(
            [{"prompt": "x"}],
            lambda r: Reports(metrics),
            scripted(tok, lambda c: "y"),
            tok,
            multi_turn_settings(),
        )


def bad_tool(table: str) -> ToolOutput:
    """Return a metric that is not a number.

    Args:
        table: ignored.
    """
    return ToolOutput(text="ok", metrics={"rows_read": None})


def test_a_tools_bad_metric_names_the_tool(tok):
    tools = ToolSet([make_tool(bad_tool)])
    with pytest.raises(EnvironmentFailure, match=r"tool 'bad_tool' reported the metric 'rows_read' = None"):
        run_trajectories(
            [{"prompt": "x"}],
            lambda r: ToolEnvironment(tools),
            scripted(tok, lambda c: tool_call_text("bad_tool", {"table": "t"})),
            tok,
            multi_turn_settings(),
        )
