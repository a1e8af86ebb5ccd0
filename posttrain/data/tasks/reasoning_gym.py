"""reasoning-gym's procedurally generated tasks as built-in data: ``data.task=reasoning_gym:<name>``.

The questions are generated locally by the ``reasoning-gym`` package (optional extra:
``pip install "posttrain[reasoning-gym]"``) from ``trainer.seed``; validation questions never repeat a training
question (the split is made on distinct question texts). Responses are scored by the package's own
``score_answer`` for the task, on the text inside ``<answer>...</answer>`` when the response has such tags, else
on the whole response stripped.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any

from posttrain.config.errors import ConfigError, DataError
from posttrain.data.records import PromptRecord

PREFIX = "reasoning_gym:"
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_MAX_ROUNDS = 4  # each round generates twice as many questions when duplicates left too few


def _package() -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ConfigError(
            "data.task=reasoning_gym:<name> needs the reasoning-gym package: pip install 'posttrain[reasoning-gym]'"
        ) from exc
    return reasoning_gym


def task_names() -> list[str]:
    """Every task name the installed reasoning-gym offers."""
    from reasoning_gym.factory import DATASETS  # the package's own registry

    _package()
    return sorted(DATASETS)


def check_task_name(name: str) -> None:
    """A ConfigError naming ``data.task`` when reasoning-gym has no task ``name``."""
    names = task_names()
    if name not in names:
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        raise ConfigError(
            f"config key 'data.task' = '{PREFIX}{name}': reasoning-gym has no task {name!r}; "
            f"its {len(names)} tasks include {shown}"
        )


def load_reasoning_gym(
    name: str,
    seed: int,
    n_train: int = 1000,
    n_val: int = 100,
    **options: Any,
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """``n_train`` training and ``n_val`` validation records of reasoning-gym task ``name``, generated from
    ``seed``, no question in both. ``options`` go to the task's own config class (``data.task_options``: e.g.
    ``max_value`` of gcd)."""
    check_task_name(name)
    rg = _package()
    check_task_options(name, options)
    want = n_train + n_val
    size = want
    for _ in range(_MAX_ROUNDS):
        entries = _distinct(rg.create_dataset(name, seed=seed, size=size, **options))
        if len(entries) >= want:
            break
        size *= 2
    if len(entries) < want:
        raise DataError(
            f"reasoning-gym task {name!r} gave only {len(entries)} distinct questions from {size} generated; "
            f"lower data.num_train_examples + data.num_val_examples (now {want})"
            + (" or widen data.task_options" if options else "")
        )
    records = [_record(name, entry) for entry in entries[:want]]
    # Shuffled before the split: in a small question space the questions first seen late are the rare kinds
    # (e.g. gcd 1 when the generator retries for a larger one), and a validation split cut from the end would
    # hold only those.
    random.Random(seed).shuffle(records)
    return records[:n_train], records[n_train:]


def check_task_options(name: str, options: dict[str, Any]) -> None:
    """A ConfigError naming ``data.task_options.<key>`` when task ``name``'s config class has no such field or
    refuses the values (the package's own checks)."""
    from reasoning_gym.factory import DATASETS  # the package's own registry: name -> (dataset, config class)

    config_cls = DATASETS[name][1]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    for key in options:
        if key not in fields:
            raise ConfigError(
                f"config key 'data.task_options.{key}' = {options[key]!r}: reasoning-gym task {name!r} has no "
                f"option {key!r}; its options are {fields}"
            )
    try:
        config = config_cls(**options, seed=0, size=1)
        if hasattr(config, "validate"):
            config.validate()
    except (AssertionError, ValueError, TypeError) as exc:
        shown = ", ".join(f"data.task_options.{k}={v!r}" for k, v in options.items())
        raise ConfigError(
            f"config keys {shown}: reasoning-gym task {name!r} refuses them ({exc or type(exc).__name__}); "
            f"its defaults are {_defaults(config_cls, fields)}"
        ) from exc


def _defaults(config_cls: Any, fields: list[str]) -> dict[str, Any]:
    plain = config_cls(seed=0, size=1)
    return {name: getattr(plain, name) for name in fields}


def _distinct(dataset: Any) -> list[dict[str, Any]]:
    seen: set[str] = set()
    out = []
    for entry in dataset:
        if entry["question"] not in seen:
            seen.add(entry["question"])
            out.append(entry)
    return out


def _record(name: str, entry: dict[str, Any]) -> PromptRecord:
    answer = entry.get("answer")
    return PromptRecord(
        prompt=entry["question"],
        ground_truth=None if answer is None else str(answer),
        extra={"data_source": f"{PREFIX}{name}", "reasoning_gym_entry": entry},
    )


def reasoning_gym_reward(
    prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any]
) -> float:
    """The task's own ``score_answer`` on the response's answer (inside ``<answer>`` tags, else all of it)."""
    entry = extra.get("reasoning_gym_entry")
    if not isinstance(entry, dict):
        raise DataError("the reasoning_gym reward needs rows generated by data.task=reasoning_gym:<name>")
    found = _ANSWER.findall(response)
    answer = (found[-1] if found else response).strip()
    score = _package().get_score_answer_fn(entry["metadata"]["source_dataset"])(answer, entry)
    return float(score)
