"""Run a reward function over many samples without letting it crash or hang the training run.

With ``timeout_s > 0`` the function runs in worker processes: each worker gets its share of the samples
in one message and sends back one small result per sample. A sample that raises, returns a non-finite
or non-numeric value, kills its worker, or takes longer than ``timeout_s`` gets ``failure_reward``; a hung
or dead worker is killed and replaced, and the rest of its share goes to the replacement. After a timeout the
rest of that worker's share is scored one sample per fresh process, all at once (at most ``_MAX_SPARES``
together): a function that hangs on every sample then costs its timeout about twice per batch, not once per
sample (32 hung samples at ``timeout_s=2`` took 66 s one after another). A function that scores several
samples at once (posttrain.rewards.many) already overlaps them within its own bound and is not spread. Workers are
started with ``fork`` where available so a function loaded from a user file needs no pickling (on
platforms without fork it must be picklable); a forked worker first lets go of the listening sockets it
inherited (torch's rendezvous store, gloo: posttrain.utils.inherited). Because the workers are daemonic, a reward function
cannot itself start ``multiprocessing`` children (``subprocess`` works).

With ``timeout_s`` None or 0 the function runs in this process: fastest, but a hung function hangs the
run. Exceptions and bad return values are still caught there.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import os
import signal
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from posttrain.config.errors import ConfigError
from posttrain.rewards import counts
from posttrain.rewards.call import OutputLog, failure_kind
from posttrain.rewards.many import call_many, samples_at_once
from posttrain.utils.console import warn_once
from posttrain.utils.inherited import drop_listening_sockets

logger = logging.getLogger("posttrain.rewards")


class RewardFunctionError(ConfigError):
    """The user's reward function failed with ``fail_fast`` set: the user's error, reported without ours."""


_STARTUP_TIMEOUT_S = 60.0  # generous: a spawned interpreter may import a lot before it is ready
_PARENT_CHECK_S = 1.0  # how often an idle worker checks that the trainer is still alive
_MAX_SPARES = 64  # one-sample processes running at once after a timeout (each holds a pipe: 2 descriptors)


@dataclass(frozen=True)
class RewardInput:
    """One sample to score."""

    prompt: str
    response: str
    ground_truth: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _worker_main(fn: Callable[..., Any], conn: Connection, parent_conn: Connection, parent_pid: int) -> None:
    """Worker loop: receive a list of ``(index, args)``, send ``(index, ok, value, output, counts)`` per sample."""
    drop_listening_sockets()  # before the user's code runs: the trainer's ports are not ours to hold
    parent_conn.close()  # keep only our end, so a closed trainer end reads as EOF here
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle, not ours
    # A forked worker inherits the trainer's SIGTERM handler (which raises in the trainer's loop); here the
    # default is right: die quietly, the trainer replaces or stops us.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    conn.send("ready")
    while True:
        # Poll rather than block so an orphaned worker (trainer killed) notices and exits.
        while not conn.poll(_PARENT_CHECK_S):
            if os.getppid() != parent_pid:
                return
        try:
            batch = conn.recv()
        except EOFError:
            return
        if batch is None:
            return
        for index, ok, value, output, kept in call_many(fn, batch):
            kept.update(counts.take())  # and what it counted from threads of its own
            try:
                conn.send((index, ok, value, output, kept))
            except OSError:  # BrokenPipeError: the trainer is gone (killed); nobody reads the answer
                return


@contextlib.contextmanager
def _sigint_seen() -> Iterator[list[int]]:
    """A list that gets an entry when a real SIGINT arrives (which then raises KeyboardInterrupt as usual)."""
    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return

    def on_sigint(signum: int, frame: Any) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


class _Worker:
    """One worker process, the samples sent to it but not yet answered, and its deadline."""

    def __init__(self, ctx: Any, fn: Callable[..., Any]) -> None:
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_worker_main, args=(fn, child_conn, self.conn, os.getpid()), daemon=True
        )
        self.process.start()
        child_conn.close()
        try:
            if not self.conn.poll(_STARTUP_TIMEOUT_S):
                raise EOFError
            self.conn.recv()  # the "ready" message
        except (EOFError, OSError) as exc:
            self.kill()
            raise RuntimeError(
                f"the reward worker process did not start within {_STARTUP_TIMEOUT_S:.0f} s "
                f"(exit code {self.process.exitcode})"
            ) from exc
        self.pending: deque[int] = deque()
        self.samples: dict[int, tuple[Any, ...]] = {}
        self.deadline = math.inf

    def submit(self, items: list[tuple[int, tuple[Any, ...]]], timeout_s: float) -> None:
        self.pending.extend(index for index, _ in items)
        self.samples.update(items)
        self.conn.send(items)
        self.deadline = time.monotonic() + timeout_s

    def unanswered(self) -> list[tuple[int, tuple[Any, ...]]]:
        return [(index, self.samples[index]) for index in self.pending]

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5.0)
        self.conn.close()

    def stop(self) -> None:
        """Ask the worker to exit; kill it if it does not within a second."""
        with contextlib.suppress(OSError):  # already dead
            self.conn.send(None)
        self.process.join(timeout=1.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5.0)
        self.conn.close()


def _stop_all(workers: list[_Worker | None], kill: bool = False) -> None:
    for i, worker in enumerate(workers):
        if worker is None:
            continue
        if kill:
            worker.kill()
        else:
            worker.stop()
        workers[i] = None


class RewardRunner:
    """Scores samples with ``fn``, turning errors and timeouts into ``failure_reward``.

    Args:
        fn: ``fn(prompt, response, ground_truth, extra) -> float``.
        timeout_s: per-sample limit in seconds; None or 0 runs ``fn`` in-process with no timeout. A function
            scoring k samples at once (``samples_at_once``, :mod:`posttrain.rewards.many`) gets k times as long
            per answer: its k calls share its resources.
        failure_reward: the reward a failed or timed-out sample gets.
        fail_fast: raise RuntimeError (with the original traceback) on the first failure instead.
        num_workers: worker processes used when ``timeout_s`` is set.

    Use as a context manager or call :meth:`close`; workers are also stopped at interpreter exit.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        timeout_s: float | None,
        failure_reward: float = 0.0,
        fail_fast: bool = False,
        num_workers: int = 1,
    ) -> None:
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s={timeout_s} must be >= 0 (0 or None: in-process, no timeout)")
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        if not math.isfinite(failure_reward):
            raise ValueError(f"failure_reward={failure_reward} must be a finite number, e.g. 0.0")
        self.fn = fn
        self.timeout_s = timeout_s or None
        self.failure_reward = float(failure_reward)
        self.fail_fast = fail_fast
        self.num_workers = num_workers
        self.first_error: str | None = None
        self._logged_kinds: set[str] = set()
        self._output = OutputLog()
        self._numbers: list[int] = []  # what messages call the samples of the current call
        if self.timeout_s is None:
            warn_once(
                "reward.timeout_s",
                "reward.timeout_s=0: the reward function runs in the trainer's own process. That gives up the "
                "timeout (a function that hangs hangs the run) and isolation from crashes (a segfault or "
                "os._exit in it ends the run); exceptions, sys.exit and bad values are still caught. Set "
                "reward.timeout_s > 0 to run it in worker processes.",
            )
        self._counts = {"failures": 0, "timeouts": 0}
        self._kept: Counter[str] = (
            Counter()
        )  # the function's own counts in this call (posttrain.rewards.counts)
        methods = mp.get_all_start_methods()
        self._ctx = mp.get_context("fork" if "fork" in methods else "spawn")
        self._workers: list[_Worker | None] = [None] * num_workers
        self._answer_wait_s = self.timeout_s or math.inf
        self._waiting: deque[tuple[int, tuple[Any, ...]]] = deque()  # samples waiting for a spare process
        # Not atexit.register(self.close): that would keep every runner alive until exit.
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker processes; a later :meth:`score` starts new ones."""
        _stop_all(self._workers)

    def score(
        self, samples: list[RewardInput], numbers: list[int] | None = None
    ) -> tuple[list[float], dict[str, float]]:
        """Rewards in sample order, and metrics ``reward/num_failures`` (every sample given
        ``failure_reward``, timeouts included), ``reward/num_timeouts`` and ``reward/time_s``, plus the counts
        the function kept (``reward/<name>``, :mod:`posttrain.rewards.counts`). ``numbers``: what log and error
        messages call each sample (default its position here; a chunk of a step's samples passes theirs)."""
        start = time.perf_counter()
        self._numbers = list(numbers) if numbers is not None else list(range(len(samples)))
        self._counts = {"failures": 0, "timeouts": 0}
        counts.take()  # drop what was counted outside a call (a start-up probe, say)
        self._kept = Counter()
        args = [(s.prompt, s.response, s.ground_truth, s.extra) for s in samples]
        if self.timeout_s is None:
            rewards = self._score_in_process(args)
        else:
            try:
                rewards = self._score_in_workers(args)
            except BaseException:
                # Workers may still be busy with this call's samples; kill them so those answers
                # never leak into the next call.
                _stop_all(self._workers, kill=True)
                raise
        metrics = {
            "reward/num_failures": float(self._counts["failures"]),
            "reward/num_timeouts": float(self._counts["timeouts"]),
            "reward/time_s": time.perf_counter() - start,
        }
        self._kept.update(counts.take())  # those counted in this process
        metrics.update({f"reward/{name}": value for name, value in sorted(self._kept.items())})
        return rewards, metrics

    def _score_in_process(self, args: list[tuple[Any, ...]]) -> list[float]:
        rewards = []
        with _sigint_seen() as seen:
            for index, ok, value, output, kept in call_many(self.fn, list(enumerate(args))):
                self._kept.update(kept)
                if seen:  # a real Ctrl-C, not a KeyboardInterrupt the function raised: the user's to have
                    raise KeyboardInterrupt
                self._output.note(self._numbers[index], output)
                rewards.append(value if ok else self._fail(index, str(value)))
        return rewards

    def _score_in_workers(self, args: list[tuple[Any, ...]]) -> list[float]:
        rewards: list[float | None] = [None] * len(args)
        # Calls that run at once share the function's resources (the code reward's sandbox slots), so each
        # answer may take that many times as long as one call alone.
        self._answer_wait_s = self.timeout_s * samples_at_once(self.fn)
        items = list(enumerate(args))
        chunk = math.ceil(len(items) / self.num_workers) if items else 0
        busy: dict[int | str, _Worker] = {}  # the persistent workers by number, spares by "spare <index>"
        self._waiting.clear()
        for w in range(self.num_workers):
            share = items[w * chunk : (w + 1) * chunk]
            if share:
                busy[w] = self._worker(w)
                busy[w].submit(share, self._answer_wait_s)
        try:
            self._run_until_answered(busy, rewards)
        except BaseException:
            for w, worker in busy.items():  # spares are in no list close() stops
                if isinstance(w, str):
                    worker.kill()
            raise
        return rewards  # type: ignore[return-value]  # every index is filled once busy is empty

    def _run_until_answered(self, busy: dict[int | str, _Worker], rewards: list[float | None]) -> None:
        while busy or self._waiting:
            self._start_spares(busy)
            by_conn = {worker.conn: w for w, worker in busy.items()}
            next_deadline = min(worker.deadline for worker in busy.values())
            ready = wait(list(by_conn), timeout=max(0.0, next_deadline - time.monotonic()))
            for conn in ready:
                self._drain(by_conn[conn], busy, rewards)
            now = time.monotonic()
            for w in [w for w, worker in busy.items() if worker.deadline <= now]:
                index = busy[w].pending[0]
                message = f"reward function timed out after {self._answer_wait_s:g} s (sample {self._numbers[index]})"
                rewards[index] = self._fail(index, message, timeout=True)
                # A function scoring several samples at once already overlaps its timeouts, within the
                # bounds it declared (the code reward's sandbox slots), which spares would bypass.
                self._replace(w, busy, spread=samples_at_once(self.fn) == 1)

    def _drain(self, w: int | str, busy: dict[int | str, _Worker], rewards: list[float | None]) -> None:
        """Read every answer worker ``w`` has sent; handle its death."""
        worker = busy[w]
        try:
            while worker.pending and worker.conn.poll():
                index, ok, value, output, kept = worker.conn.recv()
                self._kept.update(kept)
                assert index == worker.pending[0], "reward worker answered out of order"
                worker.pending.popleft()
                self._output.note(self._numbers[index], output)
                rewards[index] = value if ok else self._fail(index, value)
                worker.deadline = time.monotonic() + self._answer_wait_s
        except (EOFError, OSError):
            worker.process.join(timeout=5.0)
            index = worker.pending[0]
            message = f"reward worker process died (exit code {worker.process.exitcode}) on sample {self._numbers[index]}"
            rewards[index] = self._fail(index, message)
            self._replace(w, busy)
            return
        if not worker.pending:
            del busy[w]
            if isinstance(w, str):
                worker.kill()  # a spare serves one sample

    def _replace(self, w: int | str, busy: dict[int | str, _Worker], spread: bool = False) -> None:
        """Kill worker ``w`` (its current sample is settled) and give the rest of its share to a new one, or,
        with ``spread`` (it timed out: the function may hang on the others too), to one spare process per
        sample, so their timeouts run together."""
        old = busy.pop(w)
        old.pending.popleft()
        rest = old.unanswered()
        old.kill()
        if isinstance(w, int):
            self._workers[w] = None
        if spread:
            self._waiting.extend(rest)
        elif rest:
            busy[w] = self._worker(w) if isinstance(w, int) else _Worker(self._ctx, self.fn)
            busy[w].submit(rest, self._answer_wait_s)

    def _start_spares(self, busy: dict[int | str, _Worker]) -> None:
        """A fresh process for each waiting sample, up to _MAX_SPARES running at once."""
        running = sum(isinstance(w, str) for w in busy)
        while self._waiting and running < _MAX_SPARES:
            index, sample = self._waiting.popleft()
            spare = busy[f"spare {index}"] = _Worker(self._ctx, self.fn)
            spare.submit([(index, sample)], self._answer_wait_s)
            running += 1

    def _worker(self, w: int) -> _Worker:
        worker = self._workers[w]
        if worker is not None and not worker.process.is_alive():
            worker.kill()  # died between calls; release its pipe before replacing it
            worker = None
        if worker is None:
            worker = self._workers[w] = _Worker(self._ctx, self.fn)
        worker.pending.clear()
        worker.samples.clear()
        return worker

    def _fail(self, index: int, message: str, timeout: bool = False) -> float:
        """Count a failed sample, log the first one, and return ``failure_reward`` (or raise)."""
        index = self._numbers[index]
        self._counts["failures"] += 1
        self._counts["timeouts"] += int(timeout)
        if self.fail_fast:
            raise RewardFunctionError(
                f"reward function failed on sample {index} and reward.fail_fast=true stops the run; its error:\n"
                f"{message.rstrip()}\nFix the function, or set reward.fail_fast=false to give failing samples "
                f"reward.failure_reward={self.failure_reward:g} and go on"
            )
        if self.first_error is None:
            self.first_error = message
        kind = failure_kind(message, timeout)
        if kind not in self._logged_kinds:
            self._logged_kinds.add(kind)
            logger.warning(
                "reward function failed on sample %d (%s); it gets failure_reward=%s. Only the first failure of "
                "each kind is logged; all are counted in reward/num_failures.\n%s",
                index,
                kind,
                self.failure_reward,
                message,
            )
        return self.failure_reward
