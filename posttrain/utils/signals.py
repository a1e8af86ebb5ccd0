"""Stopping a run cleanly: SIGTERM (a scheduler's preemption, `kill`, `timeout`) ends a run like Ctrl-C does,
and neither ever interrupts a checkpoint save halfway.

- SIGTERM raises :class:`Terminated` (a BaseException, like KeyboardInterrupt, so ``except Exception`` in
  library code does not swallow it); the CLI prints one line and exits with 143 (128 + SIGTERM).
- With ``save_at_step_end`` (trainer.save_on_terminate) the first SIGTERM only asks the loop to save a
  checkpoint at the end of the current step and then stop; a second one stops at once.
- Inside :meth:`RunSignals.critical` (a checkpoint save) SIGINT and SIGTERM are held until the block ends, so
  the user gets the clean message instead of a half-written save's stack of errors; a second signal of the
  same kind during the block is not held (an escape hatch for a save that hangs).

- For a whole command (the CLI) :func:`sigterm_raises` makes SIGTERM raise :class:`Terminated` in every phase
  (loading, evaluating, exporting), not only in the training loop: the default action ends the process with
  no message and leaves its workers' pipes broken. :func:`stop_note` says, per phase, what a signal that stops
  it leaves behind (the innermost phase's note wins); the CLI prints it in one line.

Handlers can only be installed from the main thread; elsewhere (a test runner's thread) this is inert.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(BaseException):
    """The run received SIGTERM; the message says what is intact. ``noted``: the message already says what the
    signal left behind (a phase's :func:`stop_note` does not replace it)."""

    def __init__(self, message: str = "terminated (SIGTERM)", noted: bool = False) -> None:
        super().__init__(message)
        self.noted = noted


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with what the phase it stopped left behind (a KeyboardInterrupt still)."""


def _note_text(note: str | Callable[[], str]) -> str:
    return note() if callable(note) else note


@contextlib.contextmanager
def stop_note(note: str | Callable[[], str]) -> Iterator[None]:
    """A SIGINT or SIGTERM that stops the block is re-raised with ``note`` (what it left behind and what to do;
    a callable is asked then): the innermost block's note wins."""
    try:
        yield
    except Terminated as exc:
        if exc.noted:
            raise
        raise Terminated(f"terminated (SIGTERM); {_note_text(note)}", noted=True) from None
    except Interrupted:
        raise
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted; {_note_text(note)}") from None


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` in the block (a whole command), so every phase ends with the CLI's
    one line and its cleanups (reward workers stopped, partial exports deleted) instead of a silent death."""
    if not _is_main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class RunSignals:
    """SIGTERM handling for one run (see the module docstring)."""

    def __init__(self, save_at_step_end: bool = False) -> None:
        self.save_at_step_end = save_at_step_end
        self.requested = False  # SIGTERM seen, save and stop at the end of the step
        self._held: list[int] = []
        self._holding = False
        self._previous: dict[int, Any] = {}

    def install(self) -> RunSignals:
        if _is_main_thread():
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._holding and signum not in self._held:
            self._held.append(signum)
            print(
                f"{signal.Signals(signum).name}: stopping after the checkpoint being written", file=sys.stderr
            )
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.save_at_step_end and not self.requested and not self._holding:
            self.requested = True
            print("SIGTERM: saving a checkpoint at the end of this step, then stopping", file=sys.stderr)
            return
        raise Terminated("terminated (SIGTERM); the last complete checkpoint is intact")

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """Hold SIGINT and SIGTERM for the block (a checkpoint save), then act on them."""
        if not _is_main_thread():
            yield
            return
        previous_int = signal.signal(signal.SIGINT, self._on_signal)
        self._holding, self._held = True, []
        try:
            yield
        finally:
            self._holding = False
            signal.signal(signal.SIGINT, previous_int)
        if signal.SIGINT in self._held:
            raise KeyboardInterrupt
        if signal.SIGTERM in self._held:
            if not self.save_at_step_end:
                raise Terminated(
                    "terminated (SIGTERM) after a checkpoint save; that checkpoint is intact: run the same "
                    "command to resume",
                    noted=True,
                )
            self.requested = True

    def stop_after_step(
        self, step: int, saved: bool, save: Callable[[], Any], agree: Callable[[bool], bool]
    ) -> None:
        """At the end of a step: when SIGTERM asked for it (on any rank: ``agree`` ors the flag over
        ranks), save this step unless ``saved`` already, then raise Terminated."""
        if not self.save_at_step_end or not agree(self.requested):
            return
        if not saved:
            with self.critical():
                save()
        raise Terminated(
            f"terminated (SIGTERM) after saving the checkpoint of step {step}; it is intact: run the same "
            "command to resume",
            noted=True,
        )
