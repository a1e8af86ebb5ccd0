"""Counts a reward function keeps while it scores (the code reward's compile errors, time limits, sandbox
errors...), per process: the reward runner takes them after each sample, in the process that scored it (a worker
sends them back with the reward), and reports them in the step's metrics as ``reward/<name>``, summed over the
step's samples and ranks (:data:`SUMMED`)."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator

_COUNTS: Counter[str] = Counter()
_LOCK = threading.Lock()
_THIS_THREAD = threading.local()  # .counts: where a thread inside `of_this_thread` counts instead

#: The built-in code reward's counts (``posttrain.rewards.code``), every one reported at each step it scores.
CODE_COUNTS = (
    "samples",
    "cases",
    "passed",
    "no_code",
    "compile_errors",
    "time_limits",
    "memory_limits",
    "sandbox_errors",
)
#: The step metrics these counts become: summed (over samples, generation batches and ranks), never averaged.
SUMMED = tuple(f"reward/code/{name}" for name in CODE_COUNTS)


def add(prefix: str, counts: dict[str, int]) -> None:
    """Count ``counts`` as ``<prefix>/<name>`` (zeros too: the metric is then reported as 0)."""
    named = {f"{prefix}/{name}": value for name, value in counts.items()}
    own = getattr(_THIS_THREAD, "counts", None)
    if own is not None:
        own.update(named)
        return
    with _LOCK:
        _COUNTS.update(named)


@contextlib.contextmanager
def of_this_thread() -> Iterator[Counter[str]]:
    """What this thread counts inside the block, kept apart from the process's counts: samples scored at once
    in threads each get exactly their own counts (a sample scored again after a timeout is not counted
    twice)."""
    own: Counter[str] = Counter()
    _THIS_THREAD.counts = own
    try:
        yield own
    finally:
        _THIS_THREAD.counts = None


def take() -> dict[str, float]:
    """The counts since the last take, as floats; they restart from zero."""
    with _LOCK:
        out = {name: float(value) for name, value in _COUNTS.items()}
        _COUNTS.clear()
    return out
