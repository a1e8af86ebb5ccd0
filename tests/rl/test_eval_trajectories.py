"""`posttrain eval` on a multi-turn task shows whole trajectories (messages, tool calls, results, rewards), the
success rate and the turn statistics. The rows are what validation writes for multi-turn samples."""

import json

from posttrain.config.load import build_config
from posttrain.rl.eval_report import report_eval, trajectory_summary


def _rows():
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 456"}}\n</tool_call>'
    solved = {
        "prompt": "What is 123 * 456?",
        "messages": [
            {"role": "user", "content": "What is 123 * 456?"},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": "56088"},
            {"role": "assistant", "content": "56088"},
        ],
        "turns": 2,
        "reward": 1.0,
        "ground_truth": "56088",
    }
    guessed = {
        "prompt": "What is 321 * 654?",
        "messages": [
            {"role": "user", "content": "What is 321 * 654?"},
            {"role": "assistant", "content": "[209934]"},
        ],
        "turns": [[0, 9]],
        "reward": 0.0,
        "ground_truth": "209934",
    }
    return [
        solved,
        guessed,
        dict(guessed, messages=guessed["messages"][:1] + [{"role": "assistant", "content": "1"}]),
    ]


def test_summary_of_trajectories():
    summary = trajectory_summary(_rows())
    assert summary["success_rate"] == 1 / 3
    assert summary["assistant_turns/mean"] == 4 / 3 and summary["assistant_turns/max"] == 2.0
    assert summary["tool_call_rate"] == 1 / 3 and summary["tool_calls/mean"] == 1 / 3


def test_eval_report_shows_whole_trajectories(tmp_path, capsys):
    cfg = build_config(overrides=["data.task=calculator", f"trainer.run_dir={tmp_path}"])
    path = report_eval(cfg, "the model", _rows(), {"val/accuracy": 1 / 3})
    out = capsys.readouterr().out
    assert "Evaluated the model on 3 problems (the built-in 'calculator' task's held-out problems)" in out
    assert "trajectory 0: reward 1, 2 assistant turn(s)" in out
    assert (
        'tool call: <tool_call>\n    {"name": "calculator", "arguments": {"expression": "123 * 456"}}' in out
    )
    assert "tool: 56088" in out and "assistant: [209934]" in out  # rich markup in a message is printed as is
    assert "success 33.3% (1 of 3); assistant turns mean 1.33, min 1, max 2; tool call rate 33.3%" in out
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert written[0]["messages"][2] == {"role": "tool", "content": "56088"}


def test_assistant_turns_count_the_assistant_messages():
    """A tool call and an answer are two assistant turns, although the row's `turns` (verl's num_turns) is 3."""
    from posttrain.rl.eval_report import assistant_turns

    roles = ["user", "assistant", "tool", "assistant"]
    assert assistant_turns({"turns": 3, "messages": [{"role": r, "content": ""} for r in roles]}) == 2
    assert assistant_turns({"turns": 3}) == 3
