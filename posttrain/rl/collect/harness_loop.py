"""Harness rollouts inside a step: each trajectory is the user's harness (``harness.*``) talking to the policy
through the run's gateway; the calls' captured ids become one sample each (:mod:`posttrain.gateway.assemble`).

:class:`HarnessLoop` offers what :class:`~posttrain.rl.collect.multi_turn.AgentLoop` offers its users (train,
validation, `posttrain eval`): ``generate`` -> a RolloutResult with its trajectories in ``episodes``,
``tool_names``, ``summed_metrics``, ``close``. :func:`build_rollout_loop` picks the loop the config asks for.

Rewards: a harness that returns a reward REPLACES the reward function's score for that sample (and the reward
model's: the harness has judged the trajectory; ``multi_turn.SCORE_REPLACED``); it sits where environment rewards
sit (``Trajectory.turn_rewards``, on the last turn). A harness that returns None leaves the sample to the reward
function, which scores the final messages (the last call's messages and the answer it got).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain.agents.driver import engine_generate, failed_trajectory
from posttrain.agents.trajectory import Trajectory
from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.config.schema.harness import HarnessConfig, harness_enabled
from posttrain.data.records import PromptRecord
from posttrain.gateway.assemble import DROPPED_TOKENS, OVERRIDDEN, PREFIX_BREAKS, AssemblyFailure, assemble
from posttrain.gateway.harness import (
    FAILURE_KINDS,
    FAILURE_METRIC,
    Harness,
    HarnessFailure,
    load_harness,
    run_harness,
)
from posttrain.gateway.server import Gateway
from posttrain.rl.collect.multi_turn import (
    SCORE_REPLACED,
    AgentLoop,
    build_agent_loop,
    record_row,
    trajectories_result,
)
from posttrain.rollout.base import RolloutEngine, RolloutResult, SampleCallback, SamplingParams, TurnEngine
from posttrain.sandbox.build import RunSandbox

# The step metrics of harness rollouts, sums over the step (the same names on every rank and every step).
HARNESS_METRICS = (
    *(FAILURE_METRIC + kind for kind in FAILURE_KINDS),
    PREFIX_BREAKS,
    DROPPED_TOKENS,
    OVERRIDDEN,
)

# (backend) -> the run's gateway (posttrain.gateway.server.Gateway over the backend: a context manager)
GatewayFactory = Callable[[Callable], Any]


@dataclass
class HarnessLoop:
    """How a run rolls out trajectories through a harness: one gateway for the run (started at the first
    ``generate``, stopped by ``close``), one session per trajectory."""

    harness: Harness
    settings: HarnessConfig
    tokenizer: Any
    max_response_length: int  # data.max_response_length: the whole trajectory after its first prompt
    max_tokens_per_turn: int  # rollout.multi_turn.max_tokens_per_turn (0: only the trajectory budget)
    make_gateway: GatewayFactory
    eos_token_ids: set[int] = field(default_factory=set)
    tool_names: tuple[str, ...] = ()  # a harness's tools are its own: no per-tool counts
    summed_metrics: tuple[str, ...] = HARNESS_METRICS
    _gateway: Any = field(default=None, init=False, repr=False)
    _engine: TurnEngine | None = field(default=None, init=False, repr=False)

    def generate(
        self,
        engine: RolloutEngine,
        records: list[PromptRecord],
        params: SamplingParams,
        prompt_offset: int = 0,
        row_ids: list[int] | None = None,
        on_sample: SampleCallback | None = None,
    ) -> RolloutResult:
        """``params.n`` trajectories per record, prompt-major; trajectory j of record i samples under the global
        sample id ``(prompt_offset + i) * n + j``, as the native loop's would. ``on_sample`` gets each one as a
        one-sample result when it ends (a failed one, when kept, after all have ended)."""
        if not isinstance(engine, TurnEngine):
            raise ConfigError(
                f"harness.path / harness.command need a rollout engine that runs turns; {type(engine).__name__} "
                "does not (use rollout.name=native or rollout.name=vllm)"
            )
        self._engine = engine
        gateway = self._started()
        n = params.n
        rows = [record_row(r) for r in records for _ in range(n)]
        sample_ids = [(prompt_offset + i) * n + j for i in range(len(records)) for j in range(n)]
        names = [
            (row_ids[i] if row_ids else prompt_offset + i) for i in range(len(records)) for _ in range(n)
        ]
        done = None if on_sample is None else self._reporter(on_sample, n)
        trajectories = asyncio.run(self._all(gateway, rows, sample_ids, names, params, done))
        return trajectories_result(trajectories, n, self.eos_token_ids)

    def drifted(self, traj: Trajectory) -> bool:
        """Never: the gateway captured the ids the engine was given and sampled; nothing is re-rendered."""
        return False

    def close(self) -> None:
        """Stop the gateway (a later ``generate`` starts a new one)."""
        if self._gateway is not None:
            gateway, self._gateway = self._gateway, None
            gateway.__exit__(None, None, None)

    def _started(self) -> Any:
        if self._gateway is None:
            gateway = self.make_gateway(self._backend)
            gateway.__enter__()
            self._gateway = gateway
        return self._gateway

    def _backend(self, requests: list, params: SamplingParams) -> list:
        """The gateway's backend: this step's engine (the loop outlives a step's engine reference)."""
        return engine_generate(self._engine, params)(requests)

    def _reporter(self, on_sample: SampleCallback, n: int) -> Callable[[int, Trajectory], None]:
        def on_done(k: int, traj: Trajectory) -> None:
            one = trajectories_result([traj], 1, self.eos_token_ids)
            one.prompt_index = [k // n]
            on_sample(k, one)

        return on_done

    async def _all(self, gateway, rows, sample_ids, names, params, on_done) -> list[Trajectory]:
        """Every row's trajectory, at most ``harness.max_concurrent`` at once; failures as ``max_failures`` says."""
        limit = asyncio.Semaphore(self.settings.max_concurrent)

        async def one(k: int) -> Trajectory:
            async with limit:
                traj = await self._trajectory(gateway, rows[k], sample_ids[k], names[k], params)
            if on_done is not None:
                on_done(k, traj)
            return traj

        tasks = [one(k) for k in range(len(rows))]
        if self.settings.max_failures == 0:
            return list(await asyncio.gather(*tasks))
        out = await asyncio.gather(*tasks, return_exceptions=True)
        return self._kept(out, rows, on_done)

    def _kept(self, out: list, rows: list[dict], on_done) -> list[Trajectory]:
        """The trajectories, failed ones as stand-ins with nothing trained, or the run stops past max_failures."""
        for x in out:  # anything else is a bug: raise it as it is
            if isinstance(x, BaseException) and not isinstance(x, HarnessFailure):
                raise x
        failures = [x for x in out if isinstance(x, HarnessFailure)]
        limit = self.settings.max_failures
        if len(failures) > limit:
            raise HarnessFailure(
                failures[0].kind,
                f"{len(failures)} trajectories of {len(rows)} failed in their harness, more than "
                f"harness.max_failures={limit}; the first: {failures[0]}",
            ) from failures[0]
        kept = []
        for k, (row, x) in enumerate(zip(rows, out)):
            if isinstance(x, HarnessFailure):
                kind, x = x.kind, failed_trajectory(row, self.tokenizer, str(x))
                x.truncations = [f"harness failure: {out[k]}"]
                x.metrics = {FAILURE_METRIC + kind: 1.0}
                if on_done is not None:  # known only now that the step's failures are within the limit
                    on_done(k, x)
            kept.append(x)
        return kept

    async def _trajectory(self, gateway, row, sample_id, name, params) -> Trajectory:
        """One harness run in its own session, assembled into a sample; HarnessFailure naming the row."""
        timeout = self.settings.timeout_s
        session = gateway.open_session(
            sample_id=sample_id,
            params=params,
            max_response_tokens=self.max_response_length,
            max_tokens_per_turn=self.max_tokens_per_turn,
            deadline=time.monotonic() + timeout,
            render_tools=self.settings.render_tools,
        )
        where = f"row {name} (sample {sample_id})"
        try:
            result = await run_harness(self.harness, row, session.base_url, session.api_key, timeout, where)
        finally:
            records = gateway.close_session(session.id)
        try:
            traj = assemble(
                records, self.settings.on_prefix_break, self.max_response_length, sample_id
            ).trajectory
        except AssemblyFailure as exc:
            raise HarnessFailure(exc.kind, f"harness {self.harness.name!r} on {where}: {exc}") from exc
        turns = max(len(traj.turns), 1)
        traj.turn_rewards = [0.0] * turns
        if result.reward is not None:  # on the last turn: per-turn placement credits the final answer
            traj.turn_rewards[-1] = result.reward
            traj.metrics[SCORE_REPLACED] = 1.0
        traj.step_metrics = dict(result.metrics)
        return traj


def build_harness_loop(cfg: PostTrainConfig, tokenizer: Any) -> HarnessLoop:
    """The run's harness loop over a gateway made with the `harness` section's endpoint settings."""
    h, data = cfg.harness, cfg.data

    def make_gateway(backend: Callable) -> Any:
        return Gateway(
            backend,
            tokenizer,
            host=h.host,
            port=h.port,
            max_request_bytes=h.max_request_bytes,
            max_model_len=cfg.rollout.max_model_len or data.max_prompt_length + data.max_response_length,
        )

    return HarnessLoop(
        load_harness(h),
        h,
        tokenizer,
        data.max_response_length,
        cfg.rollout.multi_turn.max_tokens_per_turn,
        make_gateway,
        {tokenizer.eos_token_id},
    )


def build_rollout_loop(
    cfg: PostTrainConfig, tokenizer: Any, sandbox: RunSandbox | None = None
) -> AgentLoop | HarnessLoop | None:
    """The run's multi-turn loop: the harness's when `harness.*` names one, else posttrain's agent loop
    (``rollout.multi_turn.*``), or None for single-turn runs."""
    if harness_enabled(cfg.harness):
        return build_harness_loop(cfg, tokenizer)
    return build_agent_loop(cfg, tokenizer, sandbox)
