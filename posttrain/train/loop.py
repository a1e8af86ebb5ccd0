"""The training loop of `posttrain train`, `posttrain rm` and `posttrain sft`, written once.

A command is a step function (train step s, return its metrics) plus what it validates and what a checkpoint
of it holds; this module orders them::

    validate (a fresh run) → [crash hook → step → validate every test_freq and at the end → log → skipped-step
    guard → progress line → checkpoint every save_freq and at the end → SIGTERM check → collapse watch] → last
    metrics

It owns every setting of the loop (trainer.test_freq, save_freq, max_skipped_steps, save_on_terminate,
resume, max_ckpt_to_keep, collapse), so the three commands cannot disagree about them; the checkpoint layout,
integrity checks and atomic publishing are posttrain.train.checkpoint's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from posttrain.config.schema.run import CollapseConfig, TrainerConfig
from posttrain.parallel.runtime import DistContext
from posttrain.train.checkpoint import (
    checkpoint_root,
    find_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from posttrain.train.collapse import CollapseWatch
from posttrain.train.guards import SkippedStepGuard, check_finite_weights
from posttrain.utils.console import TrainingDisplay
from posttrain.utils.crash_hook import crash_if_asked
from posttrain.utils.metrics import SAMPLES_FILENAME, MetricsLogger, keep_records_through
from posttrain.utils.signals import RunSignals
from posttrain.utils.storage import storage_errors

Metrics = dict[str, float]


@dataclass(frozen=True)
class LoopSettings:
    """The trainer section's loop settings, with the run's length (the command's: trainer.total_steps for
    `posttrain train`, its epoch schedule's for rm and sft)."""

    total_steps: int
    test_freq: int
    save_freq: int
    max_skipped_steps: int
    save_on_terminate: bool
    collapse: CollapseConfig = field(default_factory=CollapseConfig)  # when the collapse warnings fire

    @classmethod
    def of(cls, trainer: TrainerConfig, total_steps: int) -> LoopSettings:
        return cls(
            total_steps=total_steps,
            test_freq=trainer.test_freq,
            save_freq=trainer.save_freq,
            max_skipped_steps=trainer.max_skipped_steps,
            save_on_terminate=trainer.save_on_terminate,
            collapse=trainer.collapse,
        )

    def validates_at(self, step: int) -> bool:
        return self.test_freq > 0 and (step % self.test_freq == 0 or step == self.total_steps)

    def saves_at(self, step: int) -> bool:
        return (self.save_freq > 0 and step % self.save_freq == 0) or step == self.total_steps


def _no_state(step: int) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Checkpoints:
    """What a checkpoint of the run holds (modules, optimizers and schedulers by role, plus ``loop_state(step)``:
    JSON-able state a step does not rebuild by itself, e.g. the prompt sampler), and where it goes."""

    run_dir: Path
    modules: Mapping[str, nn.Module]
    optimizers: Mapping[str, Optimizer]
    schedulers: Mapping[str, LRScheduler]
    keep_last: int
    dist: DistContext = field(default_factory=DistContext)
    loop_state: Callable[[int], dict[str, Any]] = _no_state

    def save(self, step: int) -> Path:
        """Checkpoint ``step``; refused when a weight is not finite (the last checkpoint stays a good one)."""
        check_finite_weights(self.modules, self.dist)
        state = {"step": step, **self.loop_state(step)}
        where = checkpoint_root(self.run_dir)
        with storage_errors(
            where, f"the checkpoint of step {step}", "; the last complete checkpoint is intact"
        ):
            return save_checkpoint(
                self.run_dir,
                step,
                modules=self.modules,
                optimizers=self.optimizers,
                schedulers=self.schedulers,
                trainer_state=state,
                keep_last=self.keep_last,
            )

    def resume(self, how: str, announce: bool) -> tuple[int, dict[str, Any]]:
        """Restore the checkpoint trainer.resume names (``how``: auto, disable or a path), RNG states included;
        returns (its step, its loop state), (0, {}) for a fresh run."""
        return self.restore(find_checkpoint(self.run_dir, how), announce)

    def restore(self, ckpt: Path | None, announce: bool) -> tuple[int, dict[str, Any]]:
        """Restore ``ckpt`` (found and verified by find_checkpoint; None: a fresh run), as :meth:`resume`."""
        if ckpt is None:
            return 0, {}
        # find_checkpoint verified every file (rank 0 read them), so the load does not hash them again.
        state = load_checkpoint(
            ckpt, modules=self.modules, optimizers=self.optimizers, schedulers=self.schedulers, verify=False
        )
        if announce:
            print(f"Resumed from {ckpt} (step {state['step']})")
        return int(state["step"]), state


def stopped_run_note(run_dir: Path) -> str:
    """What a signal that stops a training command leaves behind (the CLI's line): its newest checkpoint, or
    none yet."""
    saved = list_checkpoints(run_dir)
    if saved:
        return f"the last complete checkpoint is intact ({saved[-1]}): run the same command to resume"
    return "no checkpoint had been written yet: run the same command to start again"


def stopped_export_note(out: Path) -> str:
    """What a signal during a finished run's export leaves behind: no export, the final checkpoint."""
    return (
        f"the export to {out} was not finished (nothing half-written is published); the final checkpoint is "
        "intact: run the same command to finish the export"
    )


def checkpoint_step(ckpt: Path | None) -> int:
    """The step a complete checkpoint holds (0 for None): read from its manifest, before any model loads, so
    a command can refuse a finished run without loading one."""
    return 0 if ckpt is None else int(read_manifest(ckpt)["step"])


@dataclass(frozen=True)
class LoopResult:
    first_validation: Metrics  # before the first step of a fresh run ({} otherwise)
    last: Metrics  # the last step's metrics, its validation included


@dataclass
class TrainLoop:
    """One command's loop. ``step(s)`` trains step s and returns its metrics; ``validate(s)`` returns
    validation metrics (s = 0: before training), which join the step's dict; ``roles``: the trained roles
    whose ``<role>/skipped_steps`` the skipped-step guard reads. Without ``checkpoints`` nothing is saved (the
    built-in model's SFT warm start). ``logger`` is closed and ``display`` stopped when the loop ends."""

    settings: LoopSettings
    step: Callable[[int], Metrics]
    roles: Sequence[str]
    display: TrainingDisplay
    logger: MetricsLogger | None = None
    validate: Callable[[int], Metrics] | None = None
    checkpoints: Checkpoints | None = None
    dist: DistContext = field(default_factory=DistContext)

    def run(self, start: int) -> LoopResult:
        """Steps start+1..total_steps (a fresh run validates first)."""
        # Without checkpoints there is nothing to save at a step's end: SIGTERM stops at once.
        at_step_end = self.settings.save_on_terminate and self.checkpoints is not None
        self._forget_redone_steps(start)
        signals = RunSignals(save_at_step_end=at_step_end).install()
        self.display.start()
        try:
            first = self._first_validation() if start == 0 else {}
            last = first
            guard = SkippedStepGuard(self.settings.max_skipped_steps, self.roles)
            watch = CollapseWatch(self.settings.collapse)
            for step in range(start + 1, self.settings.total_steps + 1):
                last = self._one_step(step, guard, signals)
                if (
                    self.dist.rank == 0
                ):  # every rank holds the same reduced metrics: one warning, not one per rank
                    watch.observe(step, last)
        finally:
            signals.restore()
            self.display.stop()
            if self.logger is not None:
                self.logger.close()
        return LoopResult(first_validation=first, last=last)

    def _forget_redone_steps(self, start: int) -> None:
        """Records of the steps this run (re)does are written once: those a stopped run logged after its last
        checkpoint (and a fresh run's predecessors') leave metrics.jsonl and samples.jsonl before they are
        written again. Rank 0 (the one with a logger) does it."""
        if self.logger is None:
            return
        through = start if start > 0 else -1  # a fresh run validates step 0 again
        self.logger.rewind(through)
        keep_records_through(self.logger.run_dir / SAMPLES_FILENAME, through)

    def _first_validation(self) -> Metrics:
        if self.validate is None or self.settings.test_freq <= 0:
            return {}
        metrics = self.validate(0)
        self._log(metrics, 0)
        self.display.message("initial validation: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        return metrics

    def _one_step(self, step: int, guard: SkippedStepGuard, signals: RunSignals) -> Metrics:
        crash_if_asked(step, self.dist.rank)  # a test's fault (POSTTRAIN_TEST_CRASH); nothing otherwise
        metrics = self.step(step)
        if self.validate is not None and self.settings.validates_at(step):
            metrics.update(self.validate(step))
        self._log(metrics, step)
        guard.observe(step, metrics)  # after logging: the last step's skips are in metrics.jsonl
        self.display.update(step, metrics)
        if self.checkpoints is None:
            return metrics
        saved = self.settings.saves_at(step)
        if saved:
            with signals.critical():  # Ctrl-C or SIGTERM wait for the save to finish
                self.checkpoints.save(step)
        signals.stop_after_step(step, saved, lambda: self.checkpoints.save(step), self.dist.any_rank)
        return metrics

    def _log(self, metrics: Metrics, step: int) -> None:
        if self.logger is not None:
            self.logger.log(metrics, step=step)
