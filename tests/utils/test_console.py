"""TrainingDisplay and print_table under piped (non-TTY) and terminal consoles."""

from __future__ import annotations

import io
import re

from rich.console import Console

from posttrain.utils.console import TrainingDisplay, format_duration, format_value, print_table


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


class FakeClock:
    """Seconds that move only when a step says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _eta_after(step_seconds: list[float], total: int) -> tuple[float, str]:
    """Run len(step_seconds) steps of the given durations; the ETA and the last printed line."""
    clock, (console, buffer) = FakeClock(), _piped_console()
    with TrainingDisplay(total, console=console, clock=clock) as display:
        for step, seconds in enumerate(step_seconds, start=1):
            clock.now += seconds
            display.update(step, {"loss": 1.0})
        eta = display.eta_seconds(len(step_seconds))
    return eta, buffer.getvalue().splitlines()[-1]


def test_eta_follows_the_recent_pace_when_the_machine_gets_busy() -> None:
    # 20 steps of 2 s, then the machine gets busy: 8 s a step. The average since the start (4.4 s after 25
    # steps) would promise 75 steps x 4.4 s = 5.5 min; at the pace now it takes 75 x 8 s = 10 min.
    eta, line = _eta_after([2.0] * 20 + [8.0] * 5, total=100)
    assert 0.8 * 75 * 8 < eta <= 75 * 8, eta
    eta, line = _eta_after([2.0] * 20 + [8.0] * 12, total=100)
    assert abs(eta - 68 * 8) < 0.02 * 68 * 8, eta
    assert line.endswith(f"elapsed 0:02:16 | eta {format_duration(eta)}"), line


def test_eta_forgets_a_slow_first_step_and_holds_a_steady_pace() -> None:
    # A first step of 60 s (warm-up, first validation), then 1 s a step: the ETA comes down to 1 s a step
    # (29 s left after 21 steps; the average since the start would say 29 x 80 s / 21 = 110 s).
    eta, _ = _eta_after([60.0] + [1.0] * 20, total=50)
    assert abs(eta - 29) < 0.1 * 29, eta
    eta, line = _eta_after([3.0] * 10, total=40)
    assert abs(eta - 90.0) < 1e-9 and line.endswith(f"eta {format_duration(eta)}"), (eta, line)
    assert _eta_after([3.0] * 40, total=40)[0] is None  # nothing left


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
