"""Signs that a run is collapsing, read from each step's metrics: one warning line per sign, with the metric and
where the docs' advice is (docs/reliability.md, "A collapsing run").

A collapsing policy looks fine in the loss: it is the rollouts that show it. The signs, each checked at every
step and warned about once per run (its thresholds are the trainer.collapse section's knobs):

- the truncated share jumps (``truncated/share`` for multi-turn rollouts, else ``finish/length``): the model
  rambles until the token budget, e.g. a token repeated until the end;
- the entropy collapses (``actor/entropy``): the policy became (nearly) deterministic, so nothing new is sampled;
- the reward of the trained batch (``reward/mean``) is 0 for several steps in a row: no group has a signal;
- the tool-call rate (``tools/call_frequency``) rises while success (``reward/accuracy``, else ``reward/mean``)
  falls: the model learned to call tools, not to use their answers.

A metric a command does not log (sft, rm, a single-turn run's tool metrics) is never a sign.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from posttrain.config.schema.run import CollapseConfig

log = logging.getLogger("posttrain")

ADVICE = (
    "see docs/reliability.md, 'A collapsing run' (lower actor.optim.lr, raise the KL coefficient, or warm-start "
    "with more SFT steps)"
)


@dataclass
class CollapseWatch:
    """Reads each step's metrics (:meth:`observe`) and warns once per sign, through ``warn`` (a log warning by
    default). Holds only what the signs need: the first and lowest values seen and a streak."""

    thresholds: CollapseConfig = field(default_factory=CollapseConfig)  # trainer.collapse
    warn: Callable[[str], None] = log.warning
    first: dict[str, float] = field(default_factory=dict)
    lowest: dict[str, float] = field(default_factory=dict)
    zero_reward_streak: int = 0
    warned: set[str] = field(default_factory=set)

    def observe(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        """Check step ``step``'s metrics; return (and warn with) the lines of the signs that fired first now."""
        signs = [
            self._truncation(metrics),
            self._entropy(metrics),
            self._zero_reward(metrics),
            self._tools_without_success(metrics),
        ]
        self._remember(metrics)
        lines = []
        for kind, text in (s for s in signs if s is not None):
            if kind in self.warned:
                continue
            self.warned.add(kind)
            line = f"step {step}: the run may be collapsing: {text}; {ADVICE}"
            self.warn(line)
            lines.append(line)
        return lines

    def _remember(self, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.first.setdefault(key, value)
            self.lowest[key] = min(value, self.lowest.get(key, value))

    def _truncation(self, metrics: Mapping[str, float]) -> tuple[str, str] | None:
        key = "truncated/share" if "truncated/share" in metrics else "finish/length"
        if key not in metrics or key not in self.lowest:
            return None
        now, low, t = metrics[key], self.lowest[key], self.thresholds
        if now >= t.truncated_min and now - low >= t.truncated_jump:
            return "truncation", f"{key} jumped to {now:.2f} (lowest so far {low:.2f})"
        return None

    def _entropy(self, metrics: Mapping[str, float]) -> tuple[str, str] | None:
        key = "actor/entropy"
        if key not in metrics or key not in self.first or self.first[key] <= 0:
            return None
        now, start = metrics[key], self.first[key]
        if now < self.thresholds.entropy_fraction * start:
            return "entropy", f"{key} collapsed to {now:.3g} (first step {start:.3g})"
        return None

    def _zero_reward(self, metrics: Mapping[str, float]) -> tuple[str, str] | None:
        if "reward/mean" not in metrics:
            return None
        self.zero_reward_streak = self.zero_reward_streak + 1 if metrics["reward/mean"] == 0 else 0
        k = self.thresholds.zero_reward_steps
        if self.zero_reward_streak >= k:
            return "zero_reward", f"reward/mean was 0 for {self.zero_reward_streak} steps in a row"
        return None

    def _tools_without_success(self, metrics: Mapping[str, float]) -> tuple[str, str] | None:
        rate = "tools/call_frequency"
        success = "reward/accuracy" if "reward/accuracy" in metrics else "reward/mean"
        if not {rate, success} <= set(metrics) or not {rate, success} <= set(self.first):
            return None
        t = self.thresholds
        rose = metrics[rate] - self.first[rate] >= t.tool_rate_rise
        fell = self.first[success] - metrics[success] >= t.success_drop
        if rose and fell:
            return "tools", (
                f"{rate} rose {self.first[rate]:.2f} -> {metrics[rate]:.2f} while {success} fell "
                f"{self.first[success]:.3f} -> {metrics[success]:.3f}"
            )
        return None
