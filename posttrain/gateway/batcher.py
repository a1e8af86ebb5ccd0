"""The batcher between the gateway's handler threads and the engine.

Handler threads (one per connection) submit their turn and wait. One engine thread gathers what is pending (until
no new request has arrived for ``window_s``, at most ``max_wait_s``) and calls the backend once per distinct
sampling setting (``max_tokens`` does not split a group: the call gets the group's largest); only that thread ever
calls the backend, since engines are not thread-safe. A backend failure answers that group's calls with 500 and
the thread keeps serving; calls still waiting at close get 503.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from posttrain.agents.driver import Generation
from posttrain.gateway.protocol import ProtocolError
from posttrain.rollout.base import SamplingParams, TurnRequest

logger = logging.getLogger("posttrain.gateway")
Backend = Callable[[list[TurnRequest], SamplingParams], list[Generation]]


class _Waiter:
    def __init__(self, request: TurnRequest, params: SamplingParams) -> None:
        self.request, self.params = request, params
        self.done = threading.Event()
        self.result: Generation | None = None
        self.error: ProtocolError | None = None


class Batcher:
    """One engine thread calling ``backend`` with the requests gathered from the handler threads."""

    def __init__(self, backend: Backend, window_s: float = 0.002, max_wait_s: float = 0.02) -> None:
        self.backend, self.window_s, self.max_wait_s = backend, window_s, max_wait_s
        self._cond = threading.Condition()
        self._pending: list[_Waiter] = []
        self._stopping = False
        self.calls = 0  # backend calls made
        self._thread = threading.Thread(target=self._loop, name="gateway-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: TurnRequest, params: SamplingParams) -> Generation:
        """The request's sample; ProtocolError (500/503) when the backend failed or the gateway closed."""
        waiter = _Waiter(request, params)
        with self._cond:
            if self._stopping:
                raise ProtocolError(503, "the gateway is closing")
            self._pending.append(waiter)
            self._cond.notify_all()
        waiter.done.wait()
        if waiter.error is not None:
            raise waiter.error
        assert waiter.result is not None
        return waiter.result

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def _gather(self) -> list[_Waiter] | None:
        with self._cond:
            while not self._pending and not self._stopping:
                self._cond.wait()
            end = time.monotonic() + self.max_wait_s
            while not self._stopping:  # until no new request arrives for window_s (at most max_wait_s)
                seen, left = len(self._pending), end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(self.window_s, left))
                if len(self._pending) == seen:
                    break
            batch, self._pending = self._pending, []
            if self._stopping:
                for w in batch:
                    w.error = ProtocolError(503, "the gateway closed before this call was served")
                    w.done.set()
                return None
            return batch

    def _loop(self) -> None:
        while (batch := self._gather()) is not None:
            groups: dict[SamplingParams, list[_Waiter]] = {}
            for w in batch:  # max_tokens is per request: it does not split groups
                groups.setdefault(dataclasses.replace(w.params, max_tokens=1), []).append(w)
            for key, waiters in groups.items():
                self._run(key, waiters)

    def _run(self, key: SamplingParams, waiters: list[_Waiter]) -> None:
        params = dataclasses.replace(key, max_tokens=max(w.request.max_tokens for w in waiters))
        try:
            self.calls += 1
            out = list(self.backend([w.request for w in waiters], params))
            if len(out) != len(waiters):
                raise RuntimeError(f"the backend returned {len(out)} generations for {len(waiters)} requests")
            for w, gen in zip(waiters, out):
                w.result = gen
        except Exception as exc:  # answer these calls, keep serving the others
            logger.exception("gateway: the backend failed on %d requests", len(waiters))
            for w in waiters:
                w.error = ProtocolError(500, f"the engine failed: {type(exc).__name__}: {exc}")
        for w in waiters:
            w.done.set()
