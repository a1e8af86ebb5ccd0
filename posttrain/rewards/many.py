"""Calls of a reward function over a batch of samples, one at a time or, when the function says it may, several
at once in threads.

A function opts in with a ``samples_at_once()`` attribute returning how many of its calls may run together
(the built-in code reward: its sandbox bounds the programs running at once, ``sandbox.max_concurrent``, so
samples only wait on it together, and the programs of different samples fill its slots). Everything else is
called one sample at a time, as before: a user function need not be thread-safe.

Answers come back in the order of the samples whatever order the calls end in, each with exactly the counts
(:mod:`posttrain.rewards.counts`) its own call kept, so rewards and metrics are those of calling one sample at
a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from posttrain.rewards import counts
from posttrain.rewards.call import call_one

#: ``(index, ok, reward or error text, printed output, counts the call kept)``
Answer = tuple[int, bool, Any, str, dict[str, float]]


def samples_at_once(fn: Callable[..., Any]) -> int:
    """How many calls of ``fn`` may run at once: what its ``samples_at_once()`` says, else 1."""
    declared = getattr(fn, "samples_at_once", None)
    return max(1, int(declared())) if callable(declared) else 1


def declares_samples_at_once(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` says how many of its calls may run at once (so it is thread-safe)."""
    return callable(getattr(fn, "samples_at_once", None))


def _counted_call(fn: Callable[..., Any], sample: tuple[Any, ...], capture: bool) -> tuple[Any, ...]:
    with counts.of_this_thread() as kept:
        ok, value, output = call_one(fn, sample, capture=capture)
    return ok, value, output, {name: float(n) for name, n in kept.items()}


def call_many(fn: Callable[..., Any], items: list[tuple[int, tuple[Any, ...]]]) -> Iterator[Answer]:
    """One answer per ``(index, args)`` item, in the items' order; the calls run ``samples_at_once(fn)`` at a
    time (their output is then not captured: see ``call_one``)."""
    width = min(samples_at_once(fn), len(items))
    if width <= 1:
        for index, sample in items:
            yield (index, *_counted_call(fn, sample, True))
        return
    pool = ThreadPoolExecutor(width, thread_name_prefix="reward")
    try:
        futures = [(index, pool.submit(_counted_call, fn, sample, False)) for index, sample in items]
        for index, future in futures:
            yield (index, *future.result())
    finally:
        # Abandoned (an error, fail_fast, Ctrl-C): calls not started are dropped; running ones end on their own
        # and count into their own counters, which nobody reads.
        pool.shutdown(wait=False, cancel_futures=True)
