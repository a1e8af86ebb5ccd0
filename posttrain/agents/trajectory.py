"""A multi-turn trajectory: the token stream after the prompt with its mask, turns, rewards and messages.

Layout (``response_ids``, after the prompt)::

    prompt | assistant 1 (mask 1) | tool/user (mask 0) | assistant 2 (mask 1) | ... | assistant k (mask 1)
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from posttrain.config.errors import ConfigError

FINISH_REASONS = ("stop", "length", "turn_limit")
STEP_METRIC_PREFIX = "env/"  # a step metric <key> is logged as env/<key>
STEP_TIME = "step_time_mean_s"  # env/step_time_mean_s is the driver's own: no step metric may take the name


def add_step_metrics(into: dict[str, float], metrics: Mapping[Any, Any], where: str) -> None:
    """Add ``metrics`` (one environment step's, or one tool call's) to ``into``, key by key. ConfigError, naming
    ``where``, for a key that is not a string, a value that is not a real number, or the reserved key."""
    for key, value in metrics.items():
        if not isinstance(key, str) or key == STEP_TIME:
            raise ConfigError(
                f"{where} reported the metric {key!r}: metric names are strings other than {STEP_TIME!r} "
                f"({STEP_METRIC_PREFIX}{STEP_TIME} is the driver's own); rename it"
            )
        if not isinstance(value, numbers.Real):
            raise ConfigError(
                f"{where} reported the metric {key!r} = {value!r}: a metric is a real number (int or float); "
                "report a number"
            )
        into[key] = into.get(key, 0.0) + float(value)


@dataclass
class Trajectory:
    """One episode.

    prompt_ids: [P] the rendered prompt (messages, tools, assistant header).
    response_ids: [R] every token after the prompt; ``mask[i]`` is 1 for a sampled assistant id, 0 for an
        environment token; ``logprobs[i]`` is the engine's log-prob of a sampled id, 0.0 on environment tokens.
    turns: [(start, end)] each assistant turn's slice of ``response_ids``.
    turn_rewards: the environment's reward for each assistant turn (its step after that turn; 0.0 when the turn
        was cut at the length limit and no step ran).
    messages: the whole conversation (prompt messages first; assistant content is the decoded sampled text).
    finish_reason: "stop" (the environment said done), "length" (the token budget ran out) or "turn_limit".
    truncations: why anything was cut ("tool output: ...", "trajectory budget", "turn limit").
    sample_id: the global sample id its turns were sampled under.
    tools: the tool schemas rendered in its prompt (None: no tools).
    env_step_seconds: how long each environment step took (tool calls included).
    turn_finish_reasons: the engine's finish reason of each assistant turn ("eos", "stop" or "length").
    metrics: the environment's per-episode ``metrics()`` (and the run's own counts: template drift, failures).
    step_metrics: what the environment's steps reported (``StepResult.metrics``; a tool's ``ToolOutput.metrics``
        is summed into its step's), summed per key over the steps; logged as ``env/<key>``.
    """

    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    finish_reason: str = ""
    truncations: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    num_user_turns: int = 0
    sample_id: int = 0
    tools: list[dict[str, Any]] | None = None
    env_step_seconds: list[float] = field(default_factory=list)
    turn_finish_reasons: list[str] = field(default_factory=list)
    step_metrics: dict[str, float] = field(default_factory=dict)

    def add_assistant(self, ids: list[int], logprobs: list[float]) -> None:
        start = len(self.response_ids)
        self.response_ids.extend(ids)
        self.mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs)
        self.turns.append((start, len(self.response_ids)))

    def add_environment(self, ids: list[int]) -> None:
        self.response_ids.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))

    @property
    def num_assistant_turns(self) -> int:
        return len(self.turns)

    @property
    def reward(self) -> float:
        """The environment's rewards summed over the turns."""
        return float(sum(self.turn_rewards))

    @property
    def assistant_tokens(self) -> int:
        return sum(self.mask)

    @property
    def environment_tokens(self) -> int:
        return len(self.mask) - sum(self.mask)

    def mask_spans(self) -> list[tuple[int, int, bool]]:
        """[(start, end, trained)] the runs of ``response_ids`` with one mask value, in order."""
        spans: list[tuple[int, int, bool]] = []
        for i, m in enumerate(self.mask):
            if spans and spans[-1][2] == bool(m):
                spans[-1] = (spans[-1][0], i + 1, bool(m))
            else:
                spans.append((i, i + 1, bool(m)))
        return spans

    def trained_spans(self, tokenizer: Any) -> list[dict[str, Any]]:
        """The response as the loss sees it: each run of tokens with its text (special tokens kept, so the
        template's end-of-turn tokens show), its token count and whether it is trained on (the sampled
        assistant tokens) or masked out (tool results, user replies, the template's text between turns)."""
        return [
            {
                "trained": trained,
                "tokens": end - start,
                "text": tokenizer.decode(self.response_ids[start:end], skip_special_tokens=False),
            }
            for start, end, trained in self.mask_spans()
        ]

    def turn_end_rewards(self) -> list[float]:
        """[R] each turn's reward on the last token of its assistant turn, 0.0 elsewhere (for per-turn credit)."""
        out = [0.0] * len(self.response_ids)
        for (start, end), reward in zip(self.turns, self.turn_rewards):
            if end > start:
                out[end - 1] += reward
        return out


def trajectory_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """A step's numbers over its trajectories, under the names verl and TRL users know where they exist.

    ``num_turns/*`` counts assistant and environment turns together (as verl does); ``tool_call_counts/*`` the
    tool calls per trajectory; ``tools/call_frequency`` the share of trajectories with a tool call and
    ``tools/failure_frequency`` the share of tool calls that failed; ``tool_failures/<kind>`` the failures of
    each kind; ``truncated/share`` the trajectories that ended on ``length`` or ``turn_limit``;
    ``tool_call_counts/<tool>`` the calls of each tool per trajectory; ``tools/latency_mean_s`` the mean time of
    a tool call; ``env/step_time_mean_s`` the mean time of an environment step (its tool calls included);
    ``env/<key>`` each step metric (``Trajectory.step_metrics``: summed over a trajectory's steps) per trajectory,
    a trajectory that did not report it counting 0.
    """
    if not trajectories:
        return {}
    n = len(trajectories)
    turns = [t.num_assistant_turns + t.num_user_turns for t in trajectories]
    calls = [t.metrics.get("tool_calls", 0.0) for t in trajectories]
    failures: dict[str, float] = {}
    for t in trajectories:
        for key, value in t.metrics.items():
            if key.startswith("tool_failures/"):
                failures[key] = failures.get(key, 0.0) + value
    out = {
        "num_turns/mean": sum(turns) / n,
        "num_turns/min": float(min(turns)),
        "num_turns/max": float(max(turns)),
        "tool_call_counts/mean": sum(calls) / n,
        "tool_call_counts/min": float(min(calls)),
        "tool_call_counts/max": float(max(calls)),
        "tools/call_frequency": sum(1 for c in calls if c > 0) / n,
        "tools/failure_frequency": sum(failures.values()) / sum(calls) if sum(calls) else 0.0,
        "truncated/share": sum(t.finish_reason in ("length", "turn_limit") for t in trajectories) / n,
        "tokens/assistant": float(sum(t.assistant_tokens for t in trajectories)),
        "tokens/environment": float(sum(t.environment_tokens for t in trajectories)),
        "reward/env_mean": sum(t.reward for t in trajectories) / n,
    }
    out.update(failures)
    per_tool: dict[str, float] = {}
    for t in trajectories:
        for key, value in t.metrics.items():
            if key.startswith("tool_calls/"):
                name = "tool_call_counts/" + key.split("/", 1)[1]
                per_tool[name] = per_tool.get(name, 0.0) + value / n
    out.update(per_tool)
    steps = [s for t in trajectories for s in t.env_step_seconds]
    out[STEP_METRIC_PREFIX + STEP_TIME] = sum(steps) / len(steps) if steps else 0.0
    for key in sorted({k for t in trajectories for k in t.step_metrics}):
        out[STEP_METRIC_PREFIX + key] = sum(t.step_metrics.get(key, 0.0) for t in trajectories) / n
    tool_seconds = sum(t.metrics.get("tool_seconds", 0.0) for t in trajectories)
    out["tools/latency_mean_s"] = tool_seconds / sum(calls) if sum(calls) else 0.0
    return out
