"""Run metrics: ``run_dir/metrics.jsonl`` always, TensorBoard and Weights & Biases on request.

``metrics.jsonl`` holds one JSON object per :meth:`MetricsLogger.log` call::

    {"step": 12, "reward/mean": 0.53, "kl/mean": 0.0012, "timing/rollout": 4.1}

Non-finite values (NaN, +-inf) are written as ``null``: strict JSON has no NaN, and ``jq``, pandas and
most other readers reject the ``NaN`` token Python would emit. A ``null`` reads as "no valid value at
this step" (a diverged loss shows up as a gap). TensorBoard and W&B receive the raw float.

The file is opened in append mode, so a resumed run adds to it. A resumed run redoes the steps after its
checkpoint: before it does, the training loop drops their records (:meth:`MetricsLogger.rewind`, and
:func:`keep_records_through` for ``samples.jsonl``), so every step has one record however often the run
was stopped. :func:`read_metrics` still merges records per step (later values win) for files written before.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from posttrain.config.errors import ConfigError

METRICS_FILENAME = "metrics.jsonl"
BACKENDS = ("jsonl", "tensorboard", "wandb")


def to_float(key: str, value: Any) -> float:
    """A python float from a number, numpy scalar or one-element tensor/array; ValueError otherwise."""
    if hasattr(value, "numel") and hasattr(value, "item"):  # torch.Tensor, without importing torch
        if value.numel() != 1:
            raise ValueError(
                f"metric {key!r} is a tensor with {value.numel()} elements; log a scalar (e.g. x.mean())"
            )
        return float(value.item())
    if hasattr(value, "size") and hasattr(value, "item"):  # numpy scalar or array
        if value.size != 1:
            raise ConfigError(f"metric {key!r} is an array with {value.size} elements; log a scalar")
        return float(value.item())
    if isinstance(value, (int, float)):  # bool is an int: logged as 0.0 / 1.0
        return float(value)
    raise ValueError(
        f"metric {key!r} has value {value!r} of type {type(value).__name__}; log a number or a "
        "one-element tensor"
    )


def reduce_metrics(items: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Mean of each key over the dicts that contain it (micro-batches may report different keys).

    NaN propagates on purpose: a NaN in any micro-batch should be visible in the step's metrics.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for item in items:
        for key, value in item.items():
            sums[key] = sums.get(key, 0.0) + to_float(key, value)
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` merged per step (later values win), sorted by step.

    Lines that do not parse, such as a last line cut short by a crash, are skipped with a warning.
    """
    merged: dict[int, dict[str, Any]] = {}
    bad = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (ValueError, KeyError, TypeError):
                bad += 1
                continue
            merged.setdefault(step, {"step": step}).update(record)
    if bad:
        warnings.warn(f"{path}: skipped {bad} line(s) that are not metric records", stacklevel=2)
    return [merged[step] for step in sorted(merged)]


SAMPLES_FILENAME = "samples.jsonl"


def write_samples(path: Path, rows: list[dict], step: int | None = None) -> Path:
    """Append ``rows`` (prompt, response, ground_truth, reward) to ``path`` as JSON lines, with ``step`` when
    given: `train`'s and `sft`'s validation samples, `eval`'s samples."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"step": step, **row} if step is not None else row, ensure_ascii=False) + "\n")
    return path


def keep_records_through(path: str | Path, step: int) -> None:
    """Rewrite the JSON-lines file ``path`` (metrics.jsonl, samples.jsonl) keeping only records of steps up to
    ``step`` (a negative ``step``: none): a run resumed from the checkpoint of ``step`` (a fresh run: -1)
    writes the later steps again. Records without a step and a line cut short by a crash are dropped; the
    file is replaced by one rename, so a crash meanwhile leaves the old file whole."""
    path = Path(path)
    if not path.exists():
        return
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record_step = json.loads(line).get("step")
            except (ValueError, AttributeError):
                continue
            if isinstance(record_step, int) and record_step <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_name(f".{path.name}.rewrite-{os.getpid()}")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def reward_failure_summary(path: str | Path) -> str:
    """One line for the end of a run when rewards failed in it (``reward/num_failures`` summed over the
    training steps of ``metrics.jsonl``), else ``""``."""
    if not Path(path).exists():
        return ""
    records = [r for r in read_metrics(path) if "reward/num_failures" in r]
    failures = sum(float(r.get("reward/num_failures", 0.0)) for r in records)
    if not failures:
        return ""
    timeouts = sum(float(r.get("reward/num_timeouts", 0.0)) for r in records)
    also = f", {timeouts:.0f} of them timeouts" if timeouts else ""
    plural = "s" if len(records) != 1 else ""
    return (
        f"Reward failures: {failures:.0f} samples over {len(records)} step{plural}{also} were given "
        f"reward.failure_reward (the first message of each kind is in the log; per step in {Path(path).name})"
    )


class _Backend(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class _JsonlBackend:
    def __init__(self, path: Path) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        # Flushed per step so `tail -f` and a crash both see every completed step.
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class _TensorBoardBackend:
    def __init__(self, log_dir: Path, config: Mapping[str, Any] | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "metrics backend 'tensorboard' needs the tensorboard package: "
                "pip install posttrain[tensorboard] (or drop 'tensorboard' from backends)"
            ) from err
        self._writer = SummaryWriter(log_dir=str(log_dir))
        if config:
            text = json.dumps(config, indent=2, default=str)
            self._writer.add_text("config", f"```\n{text}\n```")  # code block: TensorBoard renders markdown

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self._writer.close()


class _WandbBackend:
    def __init__(
        self, run_dir: Path, config: Mapping[str, Any] | None, project: str | None, name: str | None
    ) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError(
                "metrics backend 'wandb' needs the wandb package: pip install posttrain[wandb] "
                "(or drop 'wandb' from backends)"
            ) from err
        # No `mode=` argument: WANDB_MODE=offline/disabled in the environment keeps working as documented.
        self._run = wandb.init(project=project, name=name, config=dict(config or {}), dir=str(run_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MetricsLogger:
    """Logs one dict of scalars per step to every backend. Call from one process (rank 0) only.

    Args:
        run_dir: directory of the run; ``metrics.jsonl`` (and ``tensorboard/``) are written inside it.
        backends: any of ``BACKENDS``; ``jsonl`` is always on, listing it is optional.
        config: the run's config, shown by TensorBoard (as text) and W&B (as run config).
        project, run_name: W&B project and run name.
    """

    def __init__(
        self,
        run_dir: str | Path,
        backends: Iterable[str] = ("jsonl",),
        config: Mapping[str, Any] | None = None,
        project: str | None = None,
        run_name: str | None = None,
    ) -> None:
        backends = list(backends)
        for name in backends:
            if name not in BACKENDS:
                raise ConfigError(f"metrics backend {name!r} is unknown; valid backends: {list(BACKENDS)}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILENAME
        self._backends: list[_Backend] = [_JsonlBackend(self.path)]
        try:
            if "tensorboard" in backends:
                self._backends.append(_TensorBoardBackend(self.run_dir / "tensorboard", config))
            if "wandb" in backends:
                self._backends.append(_WandbBackend(self.run_dir, config, project, run_name))
        except BaseException:
            self.close()
            raise

    def log(self, metrics: Mapping[str, Any], step: int) -> dict[str, float]:
        """Convert ``metrics`` to floats and write them for ``step``; returns the converted dict."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step={step!r} must be a non-negative int")
        if "step" in metrics:
            raise ConfigError("metrics must not contain the key 'step'; pass the step as the step argument")
        values = {key: to_float(key, value) for key, value in metrics.items()}
        for backend in self._backends:
            backend.log(step, values)
        return values

    def rewind(self, step: int) -> None:
        """Drop the records of steps after ``step`` from metrics.jsonl (a negative ``step``: all), before a
        run resumed from the checkpoint of ``step`` writes them again (TensorBoard and W&B keep theirs)."""
        jsonl = self._backends[0]
        jsonl.close()
        keep_records_through(self.path, step)
        self._backends[0] = _JsonlBackend(self.path)

    def close(self) -> None:
        """Flush and close every backend; safe to call twice."""
        backends, self._backends = getattr(self, "_backends", []), []
        for backend in backends:
            backend.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PhaseTimer:
    """Accumulates wall-clock seconds per phase into ``timing/<phase>`` metrics.

    >>> timer = PhaseTimer()
    >>> with timer.phase("rollout"):
    ...     pass
    >>> sorted(timer.pop())
    ['timing/rollout']

    Args:
        synchronize: called at both ends of a phase, e.g. ``torch.cuda.synchronize``, so that
            asynchronous GPU work is charged to the phase that launched it.
        prefix: key prefix of the returned metrics.
    """

    def __init__(self, synchronize: Callable[[], None] | None = None, prefix: str = "timing/") -> None:
        self._synchronize = synchronize
        self._prefix = prefix
        self._seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body; repeated phases with the same name add up until :meth:`reset`."""
        if self._synchronize is not None:
            self._synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._synchronize is not None:
                self._synchronize()
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """Seconds per phase so far, keyed ``<prefix><phase>``."""
        return {f"{self._prefix}{name}": seconds for name, seconds in self._seconds.items()}

    def reset(self) -> None:
        self._seconds.clear()

    def pop(self) -> dict[str, float]:
        """:meth:`metrics`, then :meth:`reset`: call once per training step."""
        result = self.metrics()
        self.reset()
        return result
