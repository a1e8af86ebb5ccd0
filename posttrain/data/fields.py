"""Dotted paths into nested row fields, and verl's data layout.

Every data key (``data.prompt_key``, ``data.answer_key``, ``sft.response_key``) may name a nested field with
dots: ``reward_model.ground_truth`` reads ``row["reward_model"]["ground_truth"]``. A top-level field whose
name itself holds a dot wins over the nested reading, so files with such names keep loading as before.

verl's preprocessing scripts write rows as::

    {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "..."}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {"split": "train", "index": 0}}

:func:`is_verl_row` recognises that layout, so such files load with no data keys given.
"""

from __future__ import annotations

from typing import Any

#: Where verl keeps the reference answer.
VERL_ANSWER_KEY = "reward_model.ground_truth"
_MISSING = object()


def get_path(row: dict[str, Any], key: str, default: Any = _MISSING) -> Any:
    """``row[key]``, or the nested field the dotted ``key`` names; ``default`` (or KeyError) when absent."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            if default is _MISSING:
                raise KeyError(key)
            return default
        value = value[part]
    return value


def has_path(row: dict[str, Any], key: str) -> bool:
    """Whether :func:`get_path` finds ``key`` in ``row``."""
    if key in row:
        return True
    *parents, leaf = key.split(".")
    value: Any = row
    for part in parents:
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return isinstance(value, dict) and leaf in value


def is_verl_row(row: Any) -> bool:
    """Whether ``row`` is laid out as verl's preprocessing writes it: a ``data_source`` string and a
    ``reward_model`` mapping holding ``ground_truth``."""
    return (
        isinstance(row, dict)
        and isinstance(row.get("data_source"), str)
        and isinstance(row.get("reward_model"), dict)
        and "ground_truth" in row["reward_model"]
    )


def available_paths(row: dict[str, Any]) -> list[str]:
    """Every field of ``row`` as a key could name it, nested fields with dots (for error messages)."""
    out: list[str] = []
    for k, v in row.items():
        out.append(str(k))
        if isinstance(v, dict):
            out.extend(f"{k}.{sub}" for sub in available_paths(v))
    return out
