"""The multi-turn driver: a pure function of rows, an environment factory and a ``generate`` callable.

``generate(requests) -> [Generation]`` takes :class:`~posttrain.rollout.base.TurnRequest`s (the whole context's
token ids, the turn's token limit, the trajectory's sample id, the turn's position in the response and a session
key for prefix reuse) and returns, per request, the sampled ids, their log-probs and the engine's finish reason
("length" when the limit ended the turn; anything else ends the turn normally). It may be sync (it then runs on a
worker thread) or async, so any engine fits: :func:`engine_generate` adapts a ``TurnEngine``.

Each trajectory is an asyncio task. Requests for generation are gathered into one ``generate`` call from the
trajectories that are ready; a trajectory that waits for its tools or its environment is not waited for, and its
tools run while the others generate.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from posttrain.agents.env import Environment, Message, maybe_await
from posttrain.agents.env_call import EnvironmentFailure, call_environment
from posttrain.agents.render import Renderer, truncate_tool_output
from posttrain.agents.trajectory import Trajectory, add_step_metrics
from posttrain.config.errors import ConfigError
from posttrain.config.schema.agents import MultiTurnConfig
from posttrain.rollout.base import SamplingParams, TurnEngine, TurnRequest


@dataclass
class Generation:
    """One prompt's sample: ids [L], their log-probs [L], "stop" or "length"."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str


GenerateFn = Callable[[list[TurnRequest]], "list[Generation] | Awaitable[list[Generation]]"]


def engine_generate(engine: TurnEngine, params: SamplingParams) -> GenerateFn:
    """The driver's ``generate`` over a rollout engine's ``generate_turns`` (sampling settings from ``params``)."""

    def generate(requests: list[TurnRequest]) -> list[Generation]:
        result = engine.generate_turns(requests, params)
        return [
            Generation(ids, logprobs, reason)
            for ids, logprobs, reason in zip(
                result.response_ids, result.response_logprobs, result.finish_reasons
            )
        ]

    return generate


@dataclass(frozen=True)
class MultiTurnSettings:
    """What the loop reads: the run's `rollout.multi_turn` section as it is (its keys, defaults and bounds are
    the config schema's) and `data.max_response_length`, the token budget of the whole trajectory after the
    prompt, assistant and environment tokens together."""

    multi_turn: MultiTurnConfig
    max_response_length: int


class _Batcher:
    """Gathers the generation requests of the ready trajectories into one ``generate`` call."""

    def __init__(self, generate: GenerateFn) -> None:
        self.generate = generate
        self.pending: list[tuple[TurnRequest, asyncio.Future]] = []
        self.runner: asyncio.Task | None = None

    async def submit(self, request: TurnRequest) -> Generation:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((request, future))
        if self.runner is None or self.runner.done():
            self.runner = asyncio.ensure_future(self._run())
        return await future

    async def _run(self) -> None:
        while self.pending:
            for _ in range(3):  # let every trajectory that is ready now add its request
                await asyncio.sleep(0)
            batch, self.pending = self.pending, []
            try:
                out = await self._call([request for request, _ in batch])
            except Exception as exc:
                for _, future in batch:
                    future.set_exception(exc)
                continue
            for (_, future), generation in zip(batch, out):
                future.set_result(generation)

    async def _call(self, requests: list[TurnRequest]) -> list[Generation]:
        if inspect.iscoroutinefunction(self.generate):
            return await self.generate(requests)
        return await asyncio.to_thread(self.generate, requests)


def _prompt_messages(row: dict[str, Any]) -> list[Message]:
    prompt = row.get("prompt")
    if prompt is None or prompt == "" or prompt == []:
        return []
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def _truncate_messages(traj: Trajectory, messages: list[Message], renderer: Renderer, mt: MultiTurnConfig):
    out = []
    for m in messages:
        if m.get("role") == "tool":
            text, note = truncate_tool_output(
                renderer.tokenizer,
                str(m.get("content", "")),
                mt.max_tool_response_length,
                mt.tool_response_truncate_side,
            )
            if note:
                traj.truncations.append(note)
            m = {**m, "content": text}
        out.append(m)
    return out


async def run_trajectory(
    row: dict[str, Any],
    index: int,
    env: Environment,
    tokenizer: Any,
    batcher: _Batcher,
    s: MultiTurnSettings,
    sample_id: int | None = None,
) -> Trajectory:
    """One episode of ``env`` on ``row`` (see the module docstring); ``env`` is closed at the end.
    ``sample_id``: the trajectory's global sample id (its sampling noise), ``index`` by default."""
    try:
        opening = await call_environment(env, "reset", row, index, s.multi_turn.env_timeout_s)
        messages = _prompt_messages(row) + list(opening or [])
        if not messages:
            raise ConfigError(f"row {index}: no prompt and the environment's reset returned no messages")
        # render_tools=false: the calls are still parsed and run (the environment keeps its tools), only the
        # schema block stays out of the prompt.
        renderer = Renderer(tokenizer, tools=env.tool_schemas() if s.multi_turn.render_tools else None)
        traj = Trajectory(prompt_ids=renderer.prompt_ids(messages), messages=messages)
        traj.sample_id = index if sample_id is None else sample_id
        traj.tools = renderer.tools
        await _turns(traj, index, env, renderer, batcher, s)
        traj.metrics = dict(env.metrics())
        return traj
    finally:
        await maybe_await(env.close())


async def _turns(traj: Trajectory, index: int, env: Environment, renderer: Renderer, batcher, s) -> None:
    mt = s.multi_turn
    while True:
        budget = s.max_response_length - len(traj.response_ids)
        limit = min(budget, mt.max_tokens_per_turn or budget)  # max_tokens_per_turn=0: no cap of its own
        request = TurnRequest(
            ids=traj.prompt_ids + traj.response_ids,
            max_tokens=limit,
            sample_id=traj.sample_id,
            position=len(traj.response_ids),
            session=traj.sample_id,
        )
        gen = await batcher.submit(request)
        ids, logprobs = gen.ids[:limit], gen.logprobs[:limit]
        traj.add_assistant(ids, logprobs)
        text = renderer.tokenizer.decode(ids, skip_special_tokens=True)
        traj.messages.append({"role": "assistant", "content": text})
        traj.turn_finish_reasons.append(gen.finish_reason)
        if len(ids) >= budget:  # the trajectory's token budget is spent: no environment step
            traj.finish_reason = "length"
            traj.turn_rewards.append(0.0)
            traj.truncations.append("trajectory budget")
            return
        if gen.finish_reason == "length":  # cut at max_tokens_per_turn: the environment still answers
            traj.truncations.append("turn token limit")
        started = time.perf_counter()
        step = await call_environment(env, "step", text, index, s.multi_turn.env_timeout_s)
        traj.env_step_seconds.append(time.perf_counter() - started)
        traj.turn_rewards.append(float(step.reward))
        add_step_metrics(
            traj.step_metrics, step.metrics, f"environment {type(env).__name__}.step on row {index}"
        )
        if step.done or not step.messages:
            traj.finish_reason = "stop"
            return
        if traj.num_assistant_turns >= mt.max_assistant_turns or traj.num_user_turns >= mt.max_user_turns:
            traj.finish_reason = "turn_limit"
            traj.truncations.append("turn limit")
            return
        new = _truncate_messages(traj, step.messages, renderer, mt)
        new_ids = renderer.new_message_ids(new)
        if (
            not ids or ids[-1] != renderer.eos_id
        ):  # stopped on another stop token: close the turn as the template does
            new_ids = [renderer.eos_id] + new_ids
        if len(traj.response_ids) + len(new_ids) >= s.max_response_length:
            traj.finish_reason = "length"
            traj.truncations.append("trajectory budget")
            return
        traj.messages.extend(new)
        traj.num_user_turns += 1
        traj.add_environment(new_ids)


async def run_trajectories_async(
    rows: list[dict[str, Any]],
    make_env: Callable[[dict[str, Any]], Environment],
    generate: GenerateFn,
    tokenizer: Any,
    settings: MultiTurnSettings,
    sample_ids: list[int] | None = None,
    row_ids: list[int] | None = None,
    on_done: Callable[[int, Trajectory], None] | None = None,
) -> list[Trajectory]:
    """Every row's trajectory, concurrently, in row order.

    on_done: called with (row position, trajectory) as each trajectory ends (its environment closed), before
    this returns; a trajectory whose environment failed, when kept (below), once all have ended.
    sample_ids: each trajectory's global sample id (its sampling noise; default: its index here).
    row_ids: the data row each trajectory plays, for error messages (default: its index here).
    An environment that raises stops the run (:class:`EnvironmentFailure`), unless
    ``settings.multi_turn.max_env_failures`` allows it: the trajectory is then kept as :func:`failed_trajectory` (nothing in
    it is trained on) and counted in its ``metrics["env_failures"]``.
    """
    batcher = _Batcher(generate)
    sample_ids = list(range(len(rows))) if sample_ids is None else sample_ids
    row_ids = list(range(len(rows))) if row_ids is None else row_ids

    async def reported(k: int, trajectory: Awaitable[Trajectory]) -> Trajectory:
        done = await trajectory
        if on_done is not None:
            on_done(k, done)
        return done

    tasks = [
        reported(k, run_trajectory(row, r, make_env(row), tokenizer, batcher, settings, sample_id=s))
        for k, (row, r, s) in enumerate(zip(rows, row_ids, sample_ids))
    ]
    max_failures = settings.multi_turn.max_env_failures
    if max_failures == 0:
        return list(await asyncio.gather(*tasks))
    out = await asyncio.gather(*tasks, return_exceptions=True)
    failures = [x for x in out if isinstance(x, EnvironmentFailure)]
    for x in out:  # anything else is a bug or a user error: raise it as it is
        if isinstance(x, BaseException) and not isinstance(x, EnvironmentFailure):
            raise x
    if len(failures) > max_failures:
        raise EnvironmentFailure(
            f"{len(failures)} trajectories of {len(rows)} failed in their environment, more than "
            f"rollout.multi_turn.max_env_failures={max_failures}; the first: {failures[0]}"
        ) from failures[0]
    kept = []
    for k, (row, x) in enumerate(zip(rows, out)):
        if isinstance(x, EnvironmentFailure):
            x = failed_trajectory(row, tokenizer, str(x))
            if on_done is not None:  # known only now that the step's failures are within the limit
                on_done(k, x)
        kept.append(x)
    return kept


def failed_trajectory(row: dict[str, Any], tokenizer: Any, why: str) -> Trajectory:
    """The stand-in for a trajectory whose environment failed: the row's prompt, one end-of-turn token with mask 0
    (so no token of it is trained on), reward 0, ``metrics["env_failures"] = 1``."""
    messages = _prompt_messages(row)
    renderer = Renderer(tokenizer)
    prompt = renderer.prompt_ids(messages) if messages else [renderer.eos_id]
    traj = Trajectory(prompt_ids=prompt, messages=messages, finish_reason="length")
    traj.add_environment([renderer.eos_id])
    traj.truncations.append(f"environment failure: {why}")
    traj.metrics = {"env_failures": 1.0}
    return traj


def run_trajectories(
    rows: list[dict[str, Any]],
    make_env: Callable[[dict[str, Any]], Environment],
    generate: GenerateFn,
    tokenizer: Any,
    settings: MultiTurnSettings,
    sample_ids: list[int] | None = None,
    row_ids: list[int] | None = None,
    on_done: Callable[[int, Trajectory], None] | None = None,
) -> list[Trajectory]:
    """:func:`run_trajectories_async` from synchronous code (runs its own event loop)."""
    return asyncio.run(
        run_trajectories_async(rows, make_env, generate, tokenizer, settings, sample_ids, row_ids, on_done)
    )
