"""One call of a user's reward function, fenced: whatever it raises (KeyboardInterrupt and sys.exit
included), returns or prints becomes a result the runner can count, never an exception or console spam.

Output is captured at the Python level (``sys.stdout`` / ``sys.stderr``, what ``print`` and ``logging`` to
a stream write); output a C extension writes straight to file descriptor 1 or 2 is not.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import numbers
import traceback
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("posttrain.rewards")

MAX_ABS_REWARD = 1e6  # beyond this a reward is a bug (an unscaled count, a sentinel), not a signal
MAX_OUTPUT_CHARS = 2000  # per sample: a function printing megabytes must not flood the pipe either
OUTPUT_LINES_SHOWN = 5


def call_one(
    fn: Callable[..., Any], sample: tuple[Any, ...], capture: bool = True
) -> tuple[bool, float | str, str]:
    """``(True, reward, output)`` or ``(False, error text, output)``; never raises for the function's doings.

    KeyboardInterrupt and SystemExit raised by the function are its failures too. (In-process, a real Ctrl-C
    is told apart by the runner's own SIGINT handler and re-raised there.) With ``capture`` False what the
    function prints goes to the console: redirecting ``sys.stdout`` is process-wide, so calls running at once in
    threads cannot each capture their own.
    """
    out = io.StringIO()
    try:
        with (
            contextlib.redirect_stdout(out) if capture else contextlib.nullcontext(),
            contextlib.redirect_stderr(out) if capture else contextlib.nullcontext(),
        ):
            value = fn(*sample)
    except (Exception, KeyboardInterrupt, SystemExit):
        return False, traceback.format_exc(), out.getvalue()[:MAX_OUTPUT_CHARS]
    printed = out.getvalue()[:MAX_OUTPUT_CHARS]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return (
            False,
            f"reward function returned {type(value).__name__} {value!r}; it must return a float",
            printed,
        )
    value = float(value)
    if not math.isfinite(value) or abs(value) > MAX_ABS_REWARD:
        message = (
            f"reward function returned {value}; it must return a finite float with |reward| <= "
            f"{MAX_ABS_REWARD:g} (larger values are taken for a bug: they would swamp every advantage)"
        )
        return False, message, printed
    return True, value, printed


def failure_kind(message: str, timeout: bool = False) -> str:
    """A short name of a failure, so each kind is logged once: an exception type, or what went wrong."""
    if timeout:
        return "timeout"
    if message.startswith("reward worker process died"):
        return "worker died"
    if message.startswith("reward function returned"):
        return "bad return value"
    last = next((line for line in reversed(message.strip().splitlines()) if line.strip()), "")
    return last.split(":", 1)[0].strip() or "error"


class OutputLog:
    """Logs the first lines a reward function printed, once per runner; the rest is dropped."""

    def __init__(self) -> None:
        self.shown = False

    def note(self, index: int, output: str) -> None:
        if self.shown or not output.strip():
            return
        self.shown = True
        lines = output.strip().splitlines()
        more = (
            f"\n... ({len(lines) - OUTPUT_LINES_SHOWN} more lines)" if len(lines) > OUTPUT_LINES_SHOWN else ""
        )
        logger.warning(
            "the reward function printed output (sample %d; captured, so it does not flood the console; only "
            "these first lines of the first sample that printed are shown):\n%s%s",
            index,
            "\n".join(lines[:OUTPUT_LINES_SHOWN]),
            more,
        )
