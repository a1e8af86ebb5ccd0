"""Scoring samples while the rest of their step is still generated: the engine hands each sample over as it
finishes (``RolloutEngine.generate``'s ``on_sample``), a thread gives the reward runner whatever has finished so
far, and after generation the step waits only for what is left.

Exact: a reward is a function of its sample alone, so the rewards are those of scoring every sample afterwards,
and the runner's metrics of the chunks add up to those of one call over the step (failures, timeouts and the
function's counts are sums; ``reward/time_s`` is the chunks' scoring time added up). One metric is new:
``reward/wait_s``, the seconds the step waited for rewards after generation ended (scoring afterwards: all of
``reward/time_s``).

The runner is used by this thread alone while it runs: the caller scores nothing else until :meth:`finish` or
:meth:`cancel` returned.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from posttrain.rewards.runner import RewardInput, RewardRunner

#: The runner's metrics that are not counts: ``reward/time_s`` is summed too, but it is a time.
WAIT_METRIC = "reward/wait_s"


class BackgroundScoring:
    """A thread scoring the samples :meth:`add` hands it, in chunks of what has arrived meanwhile.

    Use :meth:`finish` once every sample was added (rewards in sample order, the step's metrics), or
    :meth:`cancel` when generation failed. An exception of the runner (``reward.fail_fast``, a worker that cannot
    start) stops the thread and is raised by :meth:`finish`, with its traceback.
    """

    def __init__(self, runner: RewardRunner) -> None:
        self.runner = runner
        self._arrived: list[tuple[int, RewardInput]] = []
        self._wake = threading.Condition()
        self._closed = False  # every sample was added
        self._cancelled = False
        self._rewards: dict[int, float] = {}
        self._chunk_metrics: list[dict[str, float]] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="reward-scoring", daemon=True)
        self._thread.start()

    def add(self, index: int, sample: RewardInput) -> None:
        """Queue sample ``index`` (its position in the step's rewards) for scoring."""
        with self._wake:
            self._arrived.append((index, sample))
            self._wake.notify()

    def _next_chunk(self) -> list[tuple[int, RewardInput]] | None:
        """Everything that arrived since the last chunk (waiting for some); None when there is nothing more."""
        with self._wake:
            while not (self._arrived or self._closed or self._cancelled):
                self._wake.wait()
            if self._cancelled or not self._arrived:
                return None
            chunk, self._arrived = self._arrived, []
            return chunk

    def _run(self) -> None:
        while (chunk := self._next_chunk()) is not None:
            try:
                rewards, metrics = self.runner.score([s for _, s in chunk], [i for i, _ in chunk])
            except BaseException as exc:  # raised again by finish() in the caller's thread
                self._error = exc
                return
            self._rewards.update((index, reward) for (index, _), reward in zip(chunk, rewards))
            self._chunk_metrics.append(metrics)

    def finish(self, count: int) -> tuple[list[float], dict[str, float]]:
        """Wait for the rest (``count`` samples in all) and return the rewards in sample order and the metrics
        one runner call over all of them gives, plus ``reward/wait_s``."""
        waited = time.perf_counter()
        with self._wake:
            self._closed = True
            self._wake.notify()
        try:
            self._thread.join()
        except BaseException:  # Ctrl-C while waiting: the chunk being scored ends on its own, no other starts
            with self._wake:
                self._cancelled = True
            raise
        if self._error is not None:
            raise self._error
        if sorted(self._rewards) != list(range(count)):
            raise RuntimeError(
                f"the engine reported {len(self._rewards)} finished samples (indices {sorted(self._rewards)[:8]}...) "
                f"for a result of {count}: an engine must report each sample of a generate call once"
            )
        if not self._chunk_metrics:  # no sample: the metrics of an empty call, as scoring afterwards gives
            self._chunk_metrics.append(self.runner.score([])[1])
        metrics = merge_chunk_metrics(self._chunk_metrics)
        metrics[WAIT_METRIC] = time.perf_counter() - waited
        return [self._rewards[i] for i in range(count)], metrics

    def cancel(self) -> None:
        """Stop after the chunk being scored (if any) and wait for the thread: generation failed, and the
        runner must be free for whatever comes next. An error of the thread is dropped: the caller's wins."""
        with self._wake:
            self._cancelled = True
            self._wake.notify()
        self._thread.join()


def merge_chunk_metrics(chunks: list[dict[str, float]]) -> dict[str, float]:
    """The runner's metrics of one call over the chunks' samples: every one of them is a sum over samples (or,
    ``reward/time_s``, over calls), in the order a single call lists them."""
    total: Counter[str] = Counter()
    for metrics in chunks:
        total.update(metrics)
    first = ("reward/num_failures", "reward/num_timeouts", "reward/time_s")
    rest = sorted(name for name in total if name not in first)
    return {name: float(total[name]) for name in (*first, *rest)}
