"""Multi-turn rollouts inside a step: the agent loop (``posttrain.agents.driver``) over the rollout engine, its
trajectories laid out as a :class:`RolloutResult` the single-turn machinery scores, batches and trains on.

A trajectory becomes one sample: its own prompt (rendered with the tools and the environment's opening), every
token after it as the response (assistant tokens with mask 1 and their engine log-probs, environment tokens with
mask 0 and log-prob 0), and the trajectory itself in ``result.episodes`` for rewards, placement and metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain.agents.build import EnvFactory, environment_factory
from posttrain.agents.check import sample_environment
from posttrain.agents.driver import MultiTurnSettings, engine_generate, run_trajectories
from posttrain.agents.env_call import EnvironmentFailure
from posttrain.agents.hermes import FAILURE_KINDS
from posttrain.agents.render import Renderer
from posttrain.agents.trajectory import STEP_METRIC_PREFIX, Trajectory, trajectory_metrics
from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.data.records import PromptRecord
from posttrain.parallel.shares import MAX, MIN, ShareMetrics
from posttrain.rollout.base import RolloutEngine, RolloutResult, SampleCallback, SamplingParams, TurnEngine
from posttrain.sandbox.build import RunSandbox


@dataclass
class AgentLoop:
    """How a run rolls out multi-turn trajectories: one environment per trajectory from ``make_env``."""

    make_env: EnvFactory
    tokenizer: Any
    settings: MultiTurnSettings
    turn_rewards: str = "final"
    eos_token_ids: set[int] = field(default_factory=set)
    tool_names: tuple[str, ...] = ()  # the tools a trajectory may call (their call counts are step metrics)
    summed_metrics: tuple[str, ...] = ()  # trajectory metrics logged as sums over the step (a harness loop's)

    def generate(
        self,
        engine: RolloutEngine,
        records: list[PromptRecord],
        params: SamplingParams,
        prompt_offset: int = 0,
        row_ids: list[int] | None = None,
        on_sample: SampleCallback | None = None,
    ) -> RolloutResult:
        """``params.n`` trajectories per record, prompt-major; trajectory j of record i has the global sample id
        ``(prompt_offset + i) * n + j`` (its sampling noise), as a single-turn sample would. ``on_sample`` gets
        each trajectory as a one-sample result when it ends (``RolloutEngine.generate``; one whose environment
        failed, when kept, after all have ended)."""
        if not isinstance(engine, TurnEngine):
            raise ConfigError(
                f"rollout.multi_turn.enable=true needs a rollout engine that runs turns; {type(engine).__name__} "
                "does not (use rollout.name=native or rollout.name=vllm)"
            )
        n = params.n
        rows = [record_row(r) for r in records for _ in range(n)]
        sample_ids = [(prompt_offset + i) * n + j for i in range(len(records)) for j in range(n)]
        names = [
            (row_ids[i] if row_ids else prompt_offset + i) for i in range(len(records)) for _ in range(n)
        ]
        trajectories = run_trajectories(
            rows,
            self.make_env,
            engine_generate(engine, params),
            self.tokenizer,
            self.settings,
            sample_ids,
            names,
            None if on_sample is None else self._reporter(on_sample, n),
        )
        for traj in trajectories:
            traj.metrics["template_drift"] = float(self.drifted(traj))
        return trajectories_result(trajectories, n, self.eos_token_ids)

    def _reporter(self, on_sample: SampleCallback, n: int):
        """The driver's ``on_done`` that hands each ended trajectory to ``on_sample`` as one sample."""

        def on_done(k: int, traj: Trajectory) -> None:
            one = trajectories_result([traj], 1, self.eos_token_ids)
            one.prompt_index = [k // n]
            on_sample(k, one)

        return on_done

    def close(self) -> None:
        """Nothing to release: environments close with their trajectories (a harness loop stops its gateway)."""

    def drifted(self, traj: Trajectory) -> bool:
        """Whether re-rendering the finished conversation gives other tokens than the trajectory holds."""
        if "env_failures" in traj.metrics:
            return False
        renderer = Renderer(self.tokenizer, tools=traj.tools)
        return renderer.drift(traj.messages, traj.prompt_ids + traj.response_ids).drifted


def check_not_all_failed(episodes: list[Trajectory], max_env_failures: int) -> None:
    """EnvironmentFailure when every trajectory of the step failed in its environment: each is kept untrained
    (within ``rollout.multi_turn.max_env_failures``), so no token is left to train on (the update failed later
    with "response_mask selects no token")."""
    failed = [e for e in episodes if e.metrics.get("env_failures")]
    if not episodes or len(failed) < len(episodes):
        return
    first = next((t for t in failed[0].truncations if t.startswith("environment failure: ")), "")
    raise EnvironmentFailure(
        f"every trajectory of the step ({len(episodes)}) failed in its environment, so no token is left to train "
        f"on (rollout.multi_turn.max_env_failures={max_env_failures} kept them untrained); the first: "
        f"{first.removeprefix('environment failure: ')}"
    )


def record_row(record: PromptRecord) -> dict[str, Any]:
    """The row an environment sees: the record's extra fields, its prompt and its ground truth."""
    return {**record.extra, "prompt": record.prompt, "ground_truth": record.ground_truth}


# A trajectory metric: 1.0 when its environment's reward replaces the reward function's score (a harness that
# returned a reward has judged the trajectory itself).
SCORE_REPLACED = "score_replaced"


def score_weights(result: RolloutResult) -> list[float]:
    """[S] what each sample's reward function (and reward model) score counts for: 0.0 where the environment's
    reward replaces it (``SCORE_REPLACED``), else 1.0. The score is ``weight * score + env_rewards``."""
    if result.episodes is None:
        return [1.0] * len(result)
    return [0.0 if e.metrics.get(SCORE_REPLACED) else 1.0 for e in result.episodes]


def env_rewards(result: RolloutResult) -> list[float]:
    """[S] the environment's reward of each sample (the sum over its turns; 0.0 for single-turn samples). It adds
    to the reward function's score, in training and in validation alike."""
    if result.episodes is None:
        return [0.0] * len(result)
    return [e.reward for e in result.episodes]


def finish_reason(traj: Trajectory, eos_token_ids: set[int]) -> str:
    """The sample's finish reason: "length" when the trajectory was cut (token budget or turn limit), else the
    engine's reason for its last turn ("eos" or "stop")."""
    if traj.finish_reason in ("length", "turn_limit") or not traj.turn_finish_reasons:
        return "length"
    if traj.response_ids and traj.response_ids[-1] in eos_token_ids:
        return "eos"
    return traj.turn_finish_reasons[-1] if traj.turn_finish_reasons[-1] != "length" else "stop"


def trajectories_result(trajectories: list[Trajectory], n: int, eos_token_ids: set[int]) -> RolloutResult:
    """The trajectories (``n`` per prompt, prompt-major) as one sample each (see the module docstring)."""
    return RolloutResult(
        prompt_index=[i // n for i in range(len(trajectories))],
        response_ids=[t.response_ids for t in trajectories],
        response_logprobs=[t.logprobs for t in trajectories],
        finish_reasons=[finish_reason(t, eos_token_ids) for t in trajectories],
        trainable_mask=[t.mask for t in trajectories],
        prompt_ids=[t.prompt_ids for t in trajectories],
        episodes=trajectories,
    )


def build_agent_loop(
    cfg: PostTrainConfig, tokenizer: Any, sandbox: RunSandbox | None = None
) -> AgentLoop | None:
    """The run's agent loop (``rollout.multi_turn.*``, ``env.*``), or None for single-turn runs. ``sandbox``: the
    run's, where the python tool runs code."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return None
    settings = MultiTurnSettings(mt, cfg.data.max_response_length)
    # The engines stop on the tokenizer's eos (posttrain.rl.build.build_engine): the same set here.
    sample = sample_environment(cfg, sandbox)
    tools = tuple(sample.tool_names())  # listed in the prompt or not
    sample.close()
    eos = {tokenizer.eos_token_id}
    return AgentLoop(environment_factory(cfg, sandbox), tokenizer, settings, mt.turn_rewards, eos, tools)


def metric_names(tool_names: tuple[str, ...], step_keys: tuple[str, ...] = ()) -> list[str]:
    """The trajectory metrics a step logs: the same names on every rank (ranks reduce them position by position),
    whatever the trajectories did; the same at every step but for ``env/<key>``, one per key in ``step_keys``
    (the step metrics the environments reported, on any rank: :func:`step_metric_keys`)."""
    base = trajectory_metrics([Trajectory(prompt_ids=[0], messages=[])])
    names = [k for k in base if not k.startswith(("tool_failures/", "tool_call_counts/"))]
    names += [f"tool_call_counts/{stat}" for stat in ("mean", "min", "max")]
    names += [f"tool_failures/{kind}" for kind in FAILURE_KINDS]
    names += [f"tool_call_counts/{tool}" for tool in tool_names if tool not in ("mean", "min", "max")]
    names += [STEP_METRIC_PREFIX + key for key in step_keys]
    return names + ["multi_turn/template_drift", "multi_turn/env_failures"]


def step_metric_keys(
    episodes: list[Trajectory], gather: Callable[[list[str]], list[list[str]]] | None = None
) -> tuple[str, ...]:
    """The keys of the trajectories' step metrics (``Trajectory.step_metrics``), sorted. ``gather``: every rank's
    list from this rank's (a distributed run's ``all_gather_object``), so every rank logs every rank's keys."""
    keys = sorted({key for e in episodes for key in e.step_metrics})
    if gather is not None:
        keys = sorted({key for part in gather(keys) for key in part})
    return tuple(keys)


def logged_tool_names(
    known: tuple[str, ...],
    episodes: list[Trajectory],
    gather: Callable[[list[str]], list[list[str]]] | None = None,
) -> tuple[str, ...]:
    """The tools whose call counts a step logs: the loop's ``known`` ones and any other a trajectory called (a
    SkyRL environment's tools are known only once a row has made it), on any rank (``gather``, as
    :func:`step_metric_keys`)."""
    called = sorted({k.split("/", 1)[1] for e in episodes for k in e.metrics if k.startswith("tool_calls/")})
    if gather is not None:
        called = sorted({name for part in gather(called) for name in part})
    return known + tuple(name for name in called if name not in known)


def episode_metrics(
    episodes: list[Trajectory],
    metrics: ShareMetrics,
    how: dict[str, str],
    weight: int,
    tool_names: tuple[str, ...] = (),
    step_keys: tuple[str, ...] | None = None,
    summed: tuple[str, ...] = (),
) -> None:
    """Add the trajectories' numbers (``trajectory_metrics``, under :func:`metric_names`; 0 for what did not
    happen) to ``metrics``: token totals, drifted templates and failed environments as sums over the step
    (``how["sum"]``), extremes as extremes, the rest as means over trajectories (``how["mean"]``; the step
    metrics ``env/<key>`` among them). ``step_keys``: the step metrics' keys to log (default: the episodes').
    ``summed``: more trajectory metrics (``Trajectory.metrics``) logged as sums over the step (the loop's
    ``summed_metrics``: a harness loop's failures and prefix breaks)."""
    if step_keys is None:
        step_keys = step_metric_keys(episodes)
    computed = trajectory_metrics(episodes)
    computed["multi_turn/template_drift"] = sum(e.metrics.get("template_drift", 0.0) for e in episodes)
    computed["multi_turn/env_failures"] = sum(e.metrics.get("env_failures", 0.0) for e in episodes)
    for name in metric_names(tool_names, step_keys):
        value = computed.get(name, 0.0)
        if name.endswith("/max") and name.startswith(("num_turns/", "tool_call_counts/")):
            metrics.add({name: value}, MAX)
        elif name.endswith("/min") and name.startswith(("num_turns/", "tool_call_counts/")):
            metrics.add({name: value}, MIN)
        elif name.startswith(("tokens/", "multi_turn/", "tool_failures/")):
            metrics.add({name: value}, how["sum"])
        else:
            metrics.add({name: value}, how["mean"], weight=weight)
    for name in summed:
        metrics.add({name: sum(e.metrics.get(name, 0.0) for e in episodes)}, how["sum"])
