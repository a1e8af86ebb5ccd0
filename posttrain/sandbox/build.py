"""The sandbox a run uses, built once from the `sandbox` config section: a backend, and parallel runs bounded
by ``sandbox.max_concurrent`` across the run's processes. :class:`RunSandbox` is the run's one sandbox: the
command builds it with the run and hands it to every component that runs code (the code reward, the python
tool), which build it on first use."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from posttrain.config.schema.sandbox import SandboxConfig
from posttrain.sandbox.fusion import FusionSandbox
from posttrain.sandbox.local import LocalSandbox
from posttrain.sandbox.slots import Slots
from posttrain.sandbox.types import Limits, RunRequest, RunResult


class Backend(Protocol):
    name: str
    limits: Limits
    own_pid_namespace: bool  # each run alone in a PID namespace of its own (beside the namespace's init)

    def run(self, request: RunRequest, cancel: threading.Event | None = None) -> RunResult: ...

    def describe(self) -> str: ...


class Sandbox:
    """A backend behind a concurrency limit: at most ``max_concurrent`` runs at once, whoever calls, in this
    process and the processes it forks (:class:`posttrain.sandbox.slots.Slots`)."""

    def __init__(self, backend: Backend, max_concurrent: int = 4) -> None:
        self.backend = backend
        self.max_concurrent = max_concurrent
        self._slots = Slots(max_concurrent)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = os.getpid()
        self._lock = threading.Lock()
        ref = weakref.ref(self)
        # a lock another thread held when this process forked would stay locked in the child for ever
        os.register_at_fork(after_in_child=lambda: (box := ref()) is not None and box._after_fork())

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    @property
    def limits(self) -> Limits:
        return self.backend.limits

    def describe(self) -> str:
        return f"{self.backend.describe()}; {self.limits.describe()}; {self.max_concurrent} at once"

    def run(self, request: RunRequest, cancel: threading.Event | None = None) -> RunResult:
        """``cancel``: when set, the run ends early with status sandbox_error (the server's client went away)."""
        with self._slots.held():
            if cancel is None:  # a backend written before cancellation keeps working
                return self.backend.run(request)
            return self.backend.run(request, cancel=cancel)

    def run_many(self, requests: Sequence[RunRequest]) -> list[RunResult]:
        """Results in the order of ``requests``, run up to ``max_concurrent`` at a time."""
        if len(requests) <= 1:
            return [self.run(r) for r in requests]
        with self._lock:
            # A forked process (a reward worker) inherits the pool without its threads: it needs its own.
            if self._pool is None or self._pool_pid != os.getpid():
                self._pool = ThreadPoolExecutor(self.max_concurrent, thread_name_prefix="sandbox")
                self._pool_pid = os.getpid()
        return list(self._pool.map(self.run, requests))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def build_sandbox(cfg: SandboxConfig) -> Sandbox:
    """The sandbox of ``cfg``; a ConfigError (what to install or set) when it cannot work here."""
    limits = Limits.from_config(cfg)
    if cfg.backend == "sandbox_fusion":
        fusion = cfg.sandbox_fusion
        backend: Backend = FusionSandbox(
            fusion.url, limits, fusion.request_timeout_s, fusion.max_retries, fusion.token_env
        )
    else:
        backend = LocalSandbox(limits, cfg.bwrap_path, cfg.unsafe_no_isolation)
    return Sandbox(backend, cfg.max_concurrent)


class RunSandbox:
    """The run's one sandbox, built from its `sandbox` section when a component first asks for it (a
    ConfigError then, at start-up, when it cannot work here) and shared by all of them."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self._box: Sandbox | None = None
        self._lock = threading.Lock()

    def get(self) -> Sandbox:
        with self._lock:
            if self._box is None:
                self._box = build_sandbox(self.cfg)
            return self._box

    def close(self) -> None:
        with self._lock:
            if self._box is not None:
                self._box.close()
