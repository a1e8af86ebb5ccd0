"""Multi-turn rollouts: the agent loop (`rollout.multi_turn.*`) and the environment it talks to (`env.*`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain.config.fields import knob

TRUNCATE_SIDES = ("left", "middle", "right")
TOOL_CALL_FORMATS = ("hermes",)
TURN_REWARD_PLACEMENTS = ("final", "per_turn")


@dataclass
class MultiTurnConfig:
    """The agent loop: several assistant turns per trajectory, with tool calls and environment replies between
    them. Every length is in tokens; `data.max_response_length` bounds the whole trajectory after the prompt."""

    enable: bool = knob(
        False,
        "Roll out multi-turn trajectories through the environment (`env.path`) and tools (`tool_config_path`).",
    )
    max_assistant_turns: int = knob(5, "Most assistant turns per trajectory.", min=1)
    max_user_turns: int = knob(
        5, "Most environment replies (tool results or user messages) per trajectory.", min=1
    )
    max_tokens_per_turn: int = knob(
        0, "Most tokens one assistant turn may sample; 0: only the trajectory budget.", unit="tokens", min=0
    )
    max_parallel_calls: int = knob(4, "Tool calls of one turn that run at once.", min=1)
    tool_timeout_s: float = knob(
        30.0, "Seconds one tool call may take; then the model gets a timeout error as the result.", min=0.01
    )
    max_tool_response_length: int = knob(
        256,
        "Most tokens of one tool result kept in the trajectory (see `tool_response_truncate_side`).",
        unit="tokens",
        min=1,
    )
    tool_response_truncate_side: str = knob(
        "middle",
        "Which part of a too-long tool result is kept, as in verl: left = its beginning, right = its end, "
        "middle = both ends (a marker shows where tokens were dropped).",
        choices=TRUNCATE_SIDES,
    )
    tool_config_path: str = knob(
        "", "YAML or JSON file listing the tools (Python functions by path, optional explicit schemas)."
    )
    render_tools: bool = knob(
        True,
        "Render the tools' schemas (the tool config's and the environment's) into the prompt with the chat "
        "template. false: the calls are still read out of the answers and run, but the schema block stays out of "
        "the prompt, for a model that learned its tools' call format in training (a warm start on "
        "demonstrations without the block; with the tiny tokenizer one tool's block is about 500 tokens). "
        "env.path=calculator (and data.task=calculator) sets it to false unless it is set.",
    )
    format: str = knob(
        "hermes",
        'How tool calls are written: hermes = Qwen/Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; '
        "results go back as `tool` messages through the chat template.",
        choices=TOOL_CALL_FORMATS,
    )
    turn_rewards: str = knob(
        "final",
        "Where the environment's per-turn rewards go: final = summed into the trajectory's reward on its last "
        "token; per_turn = each on the last token of its assistant turn (credit per turn with GAE).",
        choices=TURN_REWARD_PLACEMENTS,
    )
    env_timeout_s: float = knob(
        300.0,
        "Seconds one environment reset or step may take; a call past it counts as an environment failure "
        "(see max_env_failures). 0: no limit. A synchronous environment then runs in threads of its own.",
        min=0,
    )
    max_env_failures: int = knob(
        0,
        "Trajectories per step whose environment may raise in reset/step before the run stops; they are "
        "dropped and counted. 0: the first failure stops the run, naming the environment and the row.",
        min=0,
    )


@dataclass
class EnvConfig:
    """The environment of multi-turn rollouts (with `rollout.multi_turn.enable=true`)."""

    path: str = knob(
        "",
        "The environment: a built-in name (guess_number, python) or 'path/to/file.py:ClassName' (posttrain's interface, "
        "a TRL-style environment class, or a SkyRL environment via skyrl:<env_class>). Empty: the tools of "
        "`rollout.multi_turn.tool_config_path` (or none: plain turns).",
    )
    kwargs: dict[str, Any] = knob(
        default_factory=dict,
        help="Settings passed to the environment's constructor as keyword arguments (env.kwargs.NAME=VALUE).",
    )
