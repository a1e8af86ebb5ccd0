"""Where a training step's samples come from: one protocol, two implementations.

:class:`InlineRollouts` collects each step's batch when the trainer asks for it, on the trainer's own engine
(rollout and training alternate). ``posttrain.rl.overlap.queue.RolloutQueue`` hands out batches a rollout worker
generated ahead of training (``async_training``). The step, the checkpoint and validation speak to either
through :class:`RolloutSource` alone.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

from posttrain.data.batch import RolloutBatch
from posttrain.rl.collect.context import RolloutContext
from posttrain.rl.collect.phase import rollout_phase, validate_context
from posttrain.rollout.weights import RolloutWeights
from posttrain.utils.metrics import PhaseTimer


class RolloutSource(Protocol):
    """What the trainer needs of the rollouts (step numbers are 1-based; ``version`` is the last update)."""

    def take(self, step: int, timer: PhaseTimer) -> tuple[RolloutBatch, dict[str, float]]:
        """Step ``step``'s batch (this rank's share) and its rollout metrics."""
        ...

    def push(self, version: int, policy: nn.Module) -> dict[str, float]:
        """Send the actor's weights after update ``version`` to whatever generates (every rank calls it)."""
        ...

    def validate(self, step: int) -> tuple[dict[str, float], list[dict]]:
        """Validation metrics and one row per sample, with the last pushed weights."""
        ...

    def sampler_state_after(self, step: int) -> dict:
        """The prompt sampler's state after step ``step``, as the synchronous loop has it (for a checkpoint)."""
        ...

    def close(self) -> None: ...


class InlineRollouts:
    """Rollouts collected when the step asks, on the rollout context the trainer shares (its engine, prompts,
    sampler and reward)."""

    def __init__(self, context: RolloutContext, weights: RolloutWeights | None):
        self.context = context
        self.weights = weights

    def take(self, step: int, timer: PhaseTimer) -> tuple[RolloutBatch, dict[str, float]]:
        return rollout_phase(self.context, step, timer)

    def push(self, version: int, policy: nn.Module) -> dict[str, float]:
        # On one rank the native engine shares the actor's module, so this refresh is free; a sharded actor is
        # gathered (a collective: every rank calls it) into the engine's own copy.
        return self.weights.push(policy) if self.weights is not None else {}

    def validate(self, step: int) -> tuple[dict[str, float], list[dict]]:
        return validate_context(self.context, step)

    def sampler_state_after(self, step: int) -> dict:
        return self.context.sampler.state_dict()

    def close(self) -> None:
        """Nothing of its own: the engine and the reward belong to the run."""
