"""The rollout worker: the one owner of a rollout engine while rollouts run ahead of training.

Its calls run one at a time, in the order the trainer made them, on a background thread of the trainer's
process or in a process of its own (``posttrain.rl.overlap.hosts``); it neither knows nor cares which. It
generates a step's samples (at once, or with partial rollouts in two parts: start and finish), loads a weight
snapshot, validates, and reports the prompt sampler's state.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from posttrain.config.schema import PostTrainConfig
from posttrain.rl.build import build_rollout_context
from posttrain.rl.collect.context import GeneratedStep, RolloutContext, StartedStep
from posttrain.rl.collect.phase import rollout_phase, validate_context
from posttrain.rl.overlap.partial import StartedRollout, finish_rollout, start_rollout
from posttrain.utils.metrics import PhaseTimer
from posttrain.utils.seed import seed_everything


class RolloutWorker:
    """Generates with the weights of update ``version`` until it loads a newer snapshot."""

    def __init__(self, context: RolloutContext, version: int):
        self.context = context
        self.version = version
        self._started: dict[int, StartedRollout] = {}  # partial rollouts started, by step

    def ready(self) -> int:
        """The process id this worker runs in (a round trip that says it was built)."""
        return os.getpid()

    def generate(self, step: int) -> GeneratedStep:
        before = self.context.sampler.state_dict()
        timer = PhaseTimer(prefix="async/")  # background seconds: not part of the trainer's step time
        batch, metrics = rollout_phase(self.context, step, timer)
        batch.policy_versions = torch.full((batch.num_rows,), self.version, dtype=torch.long)
        metrics.update(timer.pop())
        metrics["async/policy_version"] = float(self.version)
        return GeneratedStep(batch, metrics, before)

    def start(self, step: int) -> StartedStep:
        """A partial rollout's first part (`async_training.partial_rollout`): the step's prompts and the
        first tokens of each response, kept here until :meth:`finish`."""
        started = start_rollout(self.context, step, self.version, PhaseTimer(prefix="async/"))
        self._started[step] = started
        return StartedStep(started.sampler_before)

    def finish(self, step: int) -> GeneratedStep:
        """The rest of the responses :meth:`start` left unfinished, with the weights loaded since, scored."""
        started = self._started.pop(step)
        timer = PhaseTimer(prefix="async/")
        batch, metrics = finish_rollout(self.context, started, step, self.version, timer)
        batch.policy_versions = torch.full((batch.num_rows,), started.version, dtype=torch.long)
        metrics.update(started.metrics)
        metrics.update(timer.pop())
        metrics["async/policy_version"] = float(started.version)
        return GeneratedStep(batch, metrics, started.sampler_before)

    def load(self, version: int, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Put the snapshot taken after update ``version`` into the engine."""
        self.context.engine.sync_weights(weights)
        self.version = version

    def validate(self, step: int) -> tuple[dict[str, float], list[dict]]:
        return validate_context(self.context, step)

    def sampler_state(self) -> dict:
        return self.context.sampler.state_dict()

    def close(self) -> None:
        self.context.close()


class ProcessRolloutWorker(RolloutWorker):
    """A worker in a process of its own: it builds its rollout parts from the config and the model directory,
    starts from the trainer's prompt sampler state, and waits for the trainer's weights (``version``)."""

    def __init__(
        self,
        cfg: PostTrainConfig,
        model_path: str,
        version: int,
        sampler_state: dict,
        threads: int,
        gpus: int,
    ):
        torch.set_num_threads(threads)
        seed_everything(cfg.trainer.seed)
        device = torch.device("cuda", 0) if gpus > 0 else torch.device("cpu")  # the devices Ray assigned it
        context = build_rollout_context(cfg, Path(model_path), device)
        context.sampler.load_state_dict(sampler_state)
        super().__init__(context, version)

    def node_id(self) -> str:
        """The Ray node this worker's process runs on, as Ray tells the process itself."""
        import ray

        return ray.get_runtime_context().get_node_id()
