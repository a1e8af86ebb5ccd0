"""Non-finite guards of the training loop (posttrain.train.loop): a run never trains on, or saves, NaN or
infinite weights.

`accumulate_and_step` already skips an optimizer step whose gradient norm is not finite (a NaN loss gives
one too). Here: each skip is reported, a streak of training steps whose every optimizer step was skipped
ends the run with an explanation (a diverged run would otherwise burn its whole budget doing nothing), and a
checkpoint is refused when a weight is not finite, so the last checkpoint stays a good one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from posttrain.config.errors import ConfigError
from posttrain.parallel.runtime import DistContext

log = logging.getLogger("posttrain")


class NonFiniteError(ConfigError):
    """Training produced non-finite values: a setting (learning rate, reward scale, ...) is usually the cause."""


class SkippedStepGuard:
    """Counts consecutive training steps in which every optimizer step of a role was skipped; raises at the
    ``limit``-th (trainer.max_skipped_steps: "stop after this many consecutive steps").

    A step's metrics carry ``<role>/skipped_steps`` (skipped optimizer steps; absent: none) and
    ``<role>/optimizer_steps`` (absent: one, a command that takes one optimizer step per training step) for
    each trained role in ``roles`` (actor and critic; rm; sft)."""

    def __init__(self, limit: int, roles: Sequence[str]) -> None:
        self.limit = limit
        self.roles = tuple(roles)
        self.streak = 0

    def observe(self, step: int, metrics: Mapping[str, float]) -> None:
        skipped = {r: (metrics.get(f"{r}/skipped_steps", 0.0), self._taken(r, metrics)) for r in self.roles}
        skipped = {r: counts for r, counts in skipped.items() if counts[0]}
        if not skipped:
            self.streak = 0
            return
        parts = ", ".join(f"{r}: {n:g} of {total:g}" for r, (n, total) in skipped.items())
        log.warning(
            "step %d: skipped optimizer steps with a non-finite loss or gradient (%s); the weights were left "
            "unchanged",
            step,
            parts,
        )
        all_skipped = any(n >= total for n, total in skipped.values())
        self.streak = self.streak + 1 if all_skipped else 0
        if self.streak >= self.limit:
            lrs = " or ".join(f"{r}.optim.lr" for r in skipped)
            raise NonFiniteError(
                f"steps {step - self.streak + 1}-{step}: every optimizer step of {self.streak} consecutive "
                f"training steps had a non-finite loss or gradient (trainer.max_skipped_steps={self.limit}), so "
                "training stopped; the last checkpoint is intact. Usual causes: a learning rate too high "
                f"(lower {lrs}), rewards or data of huge magnitude, or an unstable dtype (model.dtype="
                "float32); raise trainer.max_skipped_steps to tolerate longer streaks"
            )

    @staticmethod
    def _taken(role: str, metrics: Mapping[str, float]) -> float:
        return metrics.get(f"{role}/optimizer_steps", 1.0)


def check_finite_weights(modules: Mapping[str, nn.Module], ctx: DistContext) -> None:
    """Refuse to checkpoint non-finite weights. Every rank checks its own shards; all learn the verdict."""
    bad = ""
    for key, module in modules.items():
        for name, param in module.named_parameters():
            local = param.to_local() if hasattr(param, "to_local") else param  # a sharded DTensor: our shard
            if not bool(torch.isfinite(local.detach()).all()):
                bad = bad or f"{key}: {name}"
    flags = ctx.all_gather_object(bad)
    found = next((f for f in flags if f), "")
    if found:
        raise NonFiniteError(
            f"refusing to save a checkpoint: parameter {found} holds NaN or infinite values, and the last "
            "checkpoint (intact) would be replaced by a useless one. Lower <role>.optim.lr or check the rewards, "
            "then resume from the last checkpoint"
        )
