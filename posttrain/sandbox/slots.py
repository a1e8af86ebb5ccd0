"""The sandbox's concurrency slots, shared by the process that built the sandbox and every process it forks
(the reward workers), so that ``sandbox.max_concurrent`` bounds the programs of the whole run, not of each
process: the python tool in the trainer and the code reward in a worker draw on the same slots.

A slot is one byte of a memory file the forked processes inherit, held by a POSIX record lock (fcntl). The
kernel drops a process's locks when it dies, so a worker killed at the reward timeout mid-run gives its slots
back. Record locks belong to a process, not a thread, so within a process a lock-protected list of free
indices keeps each of its threads on a byte of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
import weakref
from collections.abc import Iterator

_POLL_S = 0.005  # how often a waiting run looks for a slot another process freed


class Slots:
    """``max_concurrent`` slots across this process and its forked children."""

    def __init__(self, max_concurrent: int) -> None:
        self.size = max_concurrent
        self._fd = os.memfd_create("posttrain-sandbox-slots", 0)
        os.ftruncate(self._fd, max_concurrent)
        self._reset()
        ref = weakref.ref(self)
        # A forked child (a reward worker) holds no record lock, and a lock another thread held at the fork
        # would stay locked there for ever: it starts with every index free and a fresh lock.
        os.register_at_fork(after_in_child=lambda: (slots := ref()) is not None and slots._reset())

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._free = list(range(self.size))

    def _try_take(self) -> int | None:
        with self._lock:
            free = self._free
            for i, index in enumerate(free):
                try:
                    fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, index)
                except OSError:
                    continue  # another process holds it
                del free[i]
                return index
        return None

    def _give(self, index: int) -> None:
        with self._lock:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, index)
            self._free.append(index)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold one slot while the block runs (waiting for one if all are taken)."""
        index = self._try_take()
        while index is None:
            time.sleep(_POLL_S)
            index = self._try_take()
        try:
            yield
        finally:
            self._give(index)
