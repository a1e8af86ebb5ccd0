"""The `knob` field helper: every config field carries its help text, unit and allowed values.

Keeping help text in field metadata (rather than only in comments) lets `posttrain explain`,
the docs and the error messages read it at run time, so the schema stays the single source.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any


def knob(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    unit: str = "",
    choices: tuple[Any, ...] | None = None,
    min: float | None = None,
    max: float | None = None,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with the metadata posttrain's loader and docs use.

    `min`/`max` are inclusive bounds checked by the loader; `choices` restricts the value to a set.
    """
    meta = {"help": help, "unit": unit, "choices": choices, "min": min, "max": max}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type, **overrides: Any) -> Any:
    """A nested config section with the section's defaults, or with `overrides` of some of them
    (e.g. a role-specific learning rate): the result is still defined here, in the schema."""
    factory = functools.partial(cls, **overrides) if overrides else cls
    return dataclasses.field(default_factory=factory, metadata={"help": (cls.__doc__ or "").strip()})
