"""Several distillation teachers (`distill.teachers`): which teacher scores each row, by the row's data_source,
and the teacher pass over each teacher's rows (docs/distillation.md, "A teacher per data source")."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.data.batch import RolloutBatch
from posttrain.data.records import PromptRecord
from posttrain.models.model_path import WarmStart
from posttrain.rl.teacher import check_same_tokenizer, resolve_teacher_path

NO_TEACHER = -1  # a row whose data_source has no teacher: its OPD advantage is 0
DEFAULT_NAME = "default"  # distill.teacher.path's teacher, for rows of sources not in distill.teachers


@dataclass(frozen=True)
class TeacherRoute:
    """Teacher ``i`` is ``names[i]``'s: a data_source of ``distill.teachers``, or ``"default"``
    (``distill.teacher.path``) for the rows of every other source."""

    names: tuple[str, ...]
    paths: tuple[str, ...]
    default: int  # the index of the default teacher; NO_TEACHER when distill.teacher.path is empty
    fallback_source: str  # the data_source of rows without that field (the task's or file's name)

    def keys(self) -> tuple[str, ...]:
        """The config key of each teacher's path, for messages."""
        return tuple(
            "distill.teacher.path"
            if name == DEFAULT_NAME and i == self.default
            else f"distill.teachers.{name}"
            for i, name in enumerate(self.names)
        )

    def source_of(self, record: PromptRecord) -> str:
        return str(record.extra.get("data_source", self.fallback_source))

    def teacher_of(self, record: PromptRecord) -> int:
        source = self.source_of(record)
        routed = [i for i, name in enumerate(self.names) if name == source and i != self.default]
        return routed[0] if routed else self.default

    def row_ids(self, records: Sequence[PromptRecord]) -> torch.Tensor:
        """``[len(records)]`` long: each record's teacher index, NO_TEACHER for none."""
        return torch.tensor([self.teacher_of(r) for r in records], dtype=torch.long)


def teacher_route(cfg: PostTrainConfig, fallback_source: str = "") -> TeacherRoute | None:
    """The route of ``distill.teachers`` (listed teachers first, in the config's order, then the default);
    None without that key (one teacher scores every row, or none)."""
    d = cfg.distill
    if not d.teachers:
        return None
    names, paths = list(d.teachers), list(d.teachers.values())
    default = NO_TEACHER
    if d.teacher.path:
        default = len(names)
        names.append(DEFAULT_NAME)
        paths.append(d.teacher.path)
    return TeacherRoute(tuple(names), tuple(paths), default, fallback_source)


def check_route_sources(route: TeacherRoute | None, records: Sequence[PromptRecord]) -> None:
    """Every data_source of ``distill.teachers`` must occur in the training data: a key no row has is a typo
    (its teacher would load and score nothing); ConfigError naming it and the sources present. None: no
    ``distill.teachers``, nothing to check."""
    if route is None:
        return
    present = {route.source_of(r) for r in records}
    for i, name in enumerate(route.names):
        if i != route.default and name not in present:
            shown = ", ".join(sorted(present)[:10])
            raise ConfigError(
                f"distill.teachers.{name}={route.paths[i]!r}: no training row has data_source {name!r} (the "
                f"data's sources: {shown}); use one of those as the key, or remove the entry"
            )


def routed_teacher_dirs(
    cfg: PostTrainConfig, route: TeacherRoute, model_path: Path, warm_start: WarmStart, quiet: bool
) -> list[Path]:
    """Each teacher's model directory in the route's order, its tokenizer compared with the student's (a
    ConfigError naming both keys) before any weights load."""
    dirs = []
    for path, key in zip(route.paths, route.keys()):
        teacher_dir = resolve_teacher_path(cfg, warm_start, quiet, given=path, key=key)
        check_same_tokenizer(model_path, teacher_dir, teacher_key=key)
        dirs.append(teacher_dir)
    return dirs


def teacher_dirs(
    cfg: PostTrainConfig,
    has_teacher: bool,
    data_source: str,
    model_path: Path,
    warm_start: WarmStart,
    quiet: bool,
) -> tuple[TeacherRoute | None, Path | None, list[Path]]:
    """(the rows' route, the one teacher's directory, the routed teachers' directories), each teacher's tokenizer
    checked against the student's (``model_path``): `distill.teachers` routes rows, else `distill.teacher` is the
    one teacher when the plan has a teacher pass."""
    route = teacher_route(cfg, data_source)
    if route is not None:
        return route, None, routed_teacher_dirs(cfg, route, model_path, warm_start, quiet)
    if not has_teacher or cfg.distill.teacher.base_url:  # a remote teacher has no directory here
        return None, None, []
    teacher_dir = resolve_teacher_path(cfg, warm_start, quiet)
    check_same_tokenizer(model_path, teacher_dir)
    return None, teacher_dir, []


def routed_teacher_scores(
    batch: RolloutBatch,
    teacher_ids: torch.Tensor,
    n_teachers: int,
    score: Callable[[int, RolloutBatch], torch.Tensor],
    columns: int = 0,
) -> torch.Tensor:
    """``[B, R]`` (``[B, R, columns]`` when ``columns``) the scores of each row by its own teacher,
    ``score(i, rows)`` running teacher ``i`` over its rows only; rows without a teacher (and pads) are 0."""
    out = None
    for i in range(n_teachers):
        rows = (teacher_ids == i).nonzero().squeeze(-1)
        if rows.numel() == 0:
            continue  # this step drew no row of that teacher's source
        scores = score(i, batch.select(rows))
        if out is None:
            out = scores.new_zeros((batch.num_rows, *scores.shape[1:]))
        out[rows.to(out.device)] = scores
    if out is None:  # no row has a teacher
        shape = (*batch.response_mask.shape, columns) if columns else batch.response_mask.shape
        out = torch.zeros(shape, dtype=torch.float32, device=batch.response_mask.device)
    return out


def row_counts(route: TeacherRoute, teacher_ids: torch.Tensor) -> dict[str, float]:
    """``distill/rows/<name>`` per teacher and ``distill/rows/none``: the step's rows each scored."""
    counts = {f"distill/rows/{name}": float((teacher_ids == i).sum()) for i, name in enumerate(route.names)}
    counts["distill/rows/none"] = float((teacher_ids == NO_TEACHER).sum())
    return counts
