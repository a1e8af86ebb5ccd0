"""What `posttrain eval` shows: which model, how many problems, a table of a few samples, the metrics, and
where every sample was written (``<trainer.run_dir>/eval_samples.jsonl``, replaced on each eval).

On a multi-turn task (rows with ``messages``) it shows whole trajectories instead of the table: every message
(tool calls, tool results, the environment's replies) and each trajectory's reward, then the success rate, the
turn statistics and the tool-call rate over all samples.
"""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from posttrain.config.schema import PostTrainConfig
from posttrain.rl.collect.samples import samples_table, write_samples

EVAL_SAMPLES = "eval_samples.jsonl"
TRAJECTORIES_SHOWN = 3
SUCCESS = 1.0  # as validation's accuracy: a rule reward of 1.0 is a solved sample
_STYLE = {"user": "cyan", "assistant": "green", "tool": "magenta", "system": "dim"}


def data_description(cfg: PostTrainConfig) -> str:
    if cfg.data.val_files:
        return "data.val_files=" + ",".join(cfg.data.val_files)
    return f"the built-in {cfg.data.task!r} task's held-out problems"


def assistant_turns(row: dict) -> int:
    """The row's assistant turns, counted in its messages when it has them (its ``turns`` counts the environment's
    replies too, as verl's num_turns does), else its ``turns`` (a count or the list of turn spans)."""
    messages = row.get("messages")
    if messages:
        return sum(1 for m in messages if m.get("role") == "assistant")
    turns = row.get("turns")
    if isinstance(turns, int):
        return turns
    if isinstance(turns, list):
        return len(turns)
    return 0


def _calls_tool(message: dict) -> bool:
    return message.get("role") == "assistant" and (
        bool(message.get("tool_calls")) or "<tool_call>" in str(message.get("content", ""))
    )


def trajectory_summary(rows: list[dict]) -> dict[str, float]:
    """Success rate, assistant turns (mean/min/max) and the share of trajectories that called a tool."""
    if not rows:
        return {}
    turns = [assistant_turns(r) for r in rows]
    return {
        "success_rate": sum(float(r.get("reward", 0.0)) >= SUCCESS for r in rows) / len(rows),
        "assistant_turns/mean": sum(turns) / len(turns),
        "assistant_turns/min": float(min(turns)),
        "assistant_turns/max": float(max(turns)),
        "tool_call_rate": sum(any(_calls_tool(m) for m in r.get("messages", [])) for r in rows) / len(rows),
        "tool_calls/mean": sum(sum(_calls_tool(m) for m in r.get("messages", [])) for r in rows) / len(rows),
    }


def print_trajectory(console: Console, index: int, row: dict) -> None:
    """One trajectory: a header with its reward and turns, then each message under its role."""
    finish = f", finish {row['finish_reason']}" if row.get("finish_reason") else ""
    console.print(
        f"[bold]trajectory {index}[/bold]: reward {float(row.get('reward', 0.0)):g}, "
        f"{assistant_turns(row)} assistant turn(s){finish}"
    )
    for message in row.get("messages", []):
        role = str(message.get("role", "?"))
        label = "tool call" if _calls_tool(message) else role
        text = str(message.get("content", ""))
        if message.get("tool_calls"):
            text = (text + "\n" if text else "") + "\n".join(str(c) for c in message["tool_calls"])
        body = escape(text).replace("\n", "\n    ")
        console.print(f"  [{_STYLE.get(role, 'white')}]{label}:[/] {body}")


def _print_trajectories(console: Console, rows: list[dict]) -> None:
    shown = min(len(rows), TRAJECTORIES_SHOWN)
    console.print(f"first {shown} of {len(rows)} trajectories:")
    for i, row in enumerate(rows[:shown]):
        print_trajectory(console, i, row)
    summary = trajectory_summary(rows)
    console.print(
        f"success {summary['success_rate']:.1%} ({sum(float(r.get('reward', 0.0)) >= SUCCESS for r in rows)} of "
        f"{len(rows)}); assistant turns mean {summary['assistant_turns/mean']:.2f}, min "
        f"{summary['assistant_turns/min']:g}, max {summary['assistant_turns/max']:g}; tool call rate "
        f"{summary['tool_call_rate']:.1%}, tool calls per trajectory {summary['tool_calls/mean']:.2f}"
    )


def report_eval(
    cfg: PostTrainConfig, model: str, rows: list[dict], metrics: dict[str, float], quiet: bool = False
) -> Path:
    """Write every sample to the run directory and print the summary; returns the samples file."""
    path = Path(cfg.trainer.run_dir) / EVAL_SAMPLES
    tmp = path.with_name(f".{EVAL_SAMPLES}.partial-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    write_samples(tmp, rows)
    os.replace(tmp, path)  # whole or not at all: a signal meanwhile leaves the previous eval's file
    if quiet:
        return path
    console = Console(width=120, soft_wrap=True)  # soft wrap: paths in the lines stay whole, copyable
    console.print(f"Evaluated {model} on {len(rows)} problems ({data_description(cfg)})")
    if any("messages" in r for r in rows):
        _print_trajectories(console, rows)
    else:
        console.print(samples_table(rows, f"first {min(len(rows), 5)} of {len(rows)} samples", shown=5))
    for key, value in metrics.items():
        console.print(f"{key}: {value:.4f}")
    what = (
        "trajectories (messages, rewards)"
        if any("messages" in r for r in rows)
        else "prompts, responses and rewards"
    )
    console.print(f"All {len(rows)} {what}: {path}")
    return path
