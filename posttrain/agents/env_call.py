"""One call of an environment's ``reset`` or ``step``: bounded in time, its result checked, its failure told
in one message.

- A call that takes longer than ``rollout.multi_turn.env_timeout_s`` is an environment failure (counted
  against ``rollout.multi_turn.max_env_failures`` like one that raises). A synchronous method cannot be
  interrupted, so with a timeout it runs in a daemon thread of its own and is abandoned when the time is up; an
  ``async`` one is cancelled.
- ``reset`` must return None or a list of ``{"role", "content"}`` messages, ``step`` a
  :class:`~posttrain.agents.env.StepResult`: anything else is named with the class, the method and the row
  (it failed later, deep in the driver, with a traceback of some twenty frames).
- An exception names the class, the method and the row, with the environment's own frames (those outside
  posttrain) once, instead of the driver's and asyncio's frames in two chained tracebacks.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import traceback
from pathlib import Path
from typing import Any

from posttrain.agents.env import Environment, StepResult, maybe_await
from posttrain.agents.tools import in_daemon_thread
from posttrain.config.errors import ConfigError

_OURS = (str(Path(__file__).parents[1]), str(Path(asyncio.__file__).parent), threading.__file__)


class EnvironmentFailure(ConfigError):
    """An environment raised, hung or returned the wrong type in reset or step: names the environment, the
    method and the row (the user's code, so the command line shows it as one message, exit 2)."""


async def call_environment(
    env: Environment, method: str, arg: Any, index: int, timeout_s: float = 0.0
) -> Any:
    """``env.<method>(arg)`` for row ``index``, within ``timeout_s`` seconds (0: no limit), its result checked."""
    name = f"environment {type(env).__name__}.{method}"
    fn = getattr(env, method)
    try:
        if timeout_s <= 0:
            value = await maybe_await(fn(arg))
        elif inspect.iscoroutinefunction(fn):
            value = await asyncio.wait_for(fn(arg), timeout_s)
        else:
            value = await asyncio.wait_for(in_daemon_thread(functools.partial(fn, arg), name), timeout_s)
            value = await asyncio.wait_for(maybe_await(value), timeout_s)
    except asyncio.TimeoutError:
        raise EnvironmentFailure(
            f"{name} did not return within rollout.multi_turn.env_timeout_s={timeout_s:g} s on row {index}; it "
            "counts as an environment failure (rollout.multi_turn.max_env_failures); raise the timeout if the "
            "environment is slow, not stuck"
        ) from None
    except ConfigError as exc:  # the environment's own refusal of its input: already a message
        raise EnvironmentFailure(f"{name} failed on row {index}: {exc}") from None
    except Exception as exc:
        raise EnvironmentFailure(
            f"{name} failed on row {index}: {type(exc).__name__}: {exc}{_own_frames(exc)}"
        ) from None
    _check_result(name, method, value, index)
    return value


def _check_result(name: str, method: str, value: Any, index: int) -> None:
    if method == "step" and not isinstance(value, StepResult):
        raise EnvironmentFailure(
            f"{name} returned {type(value).__name__} {value!r:.80} on row {index}; step must return a "
            "posttrain.agents.env.StepResult(messages=[...], reward=float, done=bool)"
        )
    if method == "reset" and value is not None:
        ok = isinstance(value, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value
        )
        if not ok:
            raise EnvironmentFailure(
                f"{name} returned {type(value).__name__} {value!r:.80} on row {index}; reset must return None "
                "or a list of {'role': ..., 'content': ...} messages (appended after the row's prompt)"
            )


def _own_frames(exc: BaseException) -> str:
    """The frames of the traceback outside posttrain, asyncio and threading: the environment's own code."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_OURS)]
    if not frames:
        return ""
    return "\n  the environment's own frames (most recent call last):\n" + "".join(
        "  " + line for line in traceback.format_list(frames)
    ).rstrip("\n")
