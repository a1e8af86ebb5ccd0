"""TrainingDisplay and print_table under piped (non-TTY) and terminal consoles."""

from __future__ import annotations

import io
import re

from rich.console import Console

from posttrain.utils.console import TrainingDisplay, format_value, print_table


def _piped_console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, force_terminal=False, width=60), buffer


def test_piped_output_is_one_unwrapped_line_per_step() -> None:
    console, buffer = _piped_console()
    keys = {"reward/mean": "reward", "val/accuracy": "val_acc", "response_length/mean": "len", "kl": "kl"}
    metrics = {"reward/mean": 0.53214, "response_length/mean": 143.25, "kl": 0.0012345, "other": 9.0}
    with TrainingDisplay(3, keys=keys, console=console) as display:
        for step in (1, 2, 3):
            display.update(step, metrics)
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 3, lines  # no progress-bar redraws, no wrapping despite width=60
    assert re.search(
        r"step 1/3 \| reward 0.5321 \| len 143.2 \| kl 0.001234 \| elapsed \d:\d\d:\d\d \| eta ", lines[0]
    )
    assert "val_acc" not in lines[0] and "other" not in lines[0]
    assert "\x1b[" not in buffer.getvalue()  # no escape codes in logs
    assert "step 3/3" in lines[2] and "eta" not in lines[2]


def test_every_and_disable() -> None:
    console, buffer = _piped_console()
    with TrainingDisplay(5, console=console, every=2) as display:
        for step in range(1, 6):
            display.update(step, {"loss": 1.0})
    assert [line.split("step ")[1].split(" ")[0] for line in buffer.getvalue().splitlines()] == [
        "2/5",
        "4/5",
        "5/5",
    ]
    console, buffer = _piped_console()
    with TrainingDisplay(5, console=console, disable=True) as display:
        display.update(1, {"loss": 1.0})
        display.message("saved")
    assert buffer.getvalue() == ""


def test_terminal_console_with_live_bar_runs(monkeypatch) -> None:
    monkeypatch.setenv("TERM", "xterm-256color")  # TERM=dumb (some CI) would turn the live bar off
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=100)
    with TrainingDisplay(2, console=console, start_step=0) as display:
        assert display.live
        display.update(1, {"reward": 1.0})
        display.message("saved checkpoint step_000001")
        display.update(2, {"reward": 2.0})
    out = buffer.getvalue()
    assert "reward" in out and "saved checkpoint" in out and "2/2" in out


def test_print_table_and_format_value() -> None:
    console, buffer = _piped_console()
    rows = [
        {
            "task": "gsm8k",
            "accuracy": 0.61234,
            "samples": 1319,
            "long_column_name_one": 1.0,
            "long_column_name_two": 2.0,
            "long_column_name_three": 3.0,
        }
    ]
    print_table("validation", rows, console=console)
    out = buffer.getvalue()
    assert "validation" in out and "gsm8k" in out and "0.6123" in out and "long_column_name_three" in out
    print_table("empty", [], console=console)
    assert "empty: (no rows)" in buffer.getvalue()
    assert [format_value(v) for v in (None, 12345.6, 143.25, 1.5e-7, float("nan"))] == [
        "-",
        "12346",
        "143.2",
        "1.5e-07",
        "nan",
    ]
