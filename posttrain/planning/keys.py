"""`posttrain explain --keys`: every config key with its type, default, allowed values, unit and meaning."""

from __future__ import annotations

import typing

from posttrain.config.load import all_keys, field_info, flatten, to_dict
from posttrain.config.schema import PostTrainConfig


def _type_name(hint) -> str:
    if typing.get_origin(hint) is dict:
        return "mapping NAME -> value"
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint) or (str,)
        return f"list[{getattr(item, '__name__', item)}]"
    return getattr(hint, "__name__", str(hint))


def _value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return repr(value) if value == "" else str(value)


def key_lines() -> list[str]:
    """One line per key: ``key (type, default D[, one of A|B][, min..max]) [unit]: help``.

    Defaults come from a default config, not the field: a section may override its class's defaults
    (actor.optim.lr is 2e-4, sft.optim.lr 1e-3)."""
    defaults = flatten(to_dict(PostTrainConfig()))
    lines = []
    for key in all_keys():
        field, hint = field_info(key)
        meta = field.metadata
        parts = [_type_name(hint), f"default {_value(defaults[key])}"]
        if meta.get("choices"):
            parts.append("one of " + "|".join(_value(c) for c in meta["choices"]))
        if meta.get("min") is not None or meta.get("max") is not None:
            lo = "" if meta.get("min") is None else _value(meta["min"])
            hi = "" if meta.get("max") is None else _value(meta["max"])
            parts.append(f"range {lo}..{hi}")
        unit = f" [{meta['unit']}]" if meta.get("unit") else ""
        lines.append(f"{key} ({', '.join(parts)}){unit}: {meta.get('help', '')}")
    return lines
