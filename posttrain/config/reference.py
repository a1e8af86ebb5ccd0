"""Render the configuration reference (docs/config.md) from the schema, so docs never drift.

Regenerate with: python -m posttrain.config.reference > docs/config.md
"""

from __future__ import annotations

import dataclasses
import typing

from posttrain.config.load import field_info
from posttrain.config.schema import PostTrainConfig

HEADER = """# Configuration reference

Generated from `posttrain/config/schema/` (the only place defaults live) by
`python -m posttrain.config.reference > docs/config.md`; a test keeps this file in sync.

Units: *prompts* count unique prompts, *samples* count prompt x response pairs (prompts x `rollout.n`).
*per DP rank* sizes are per data-parallel rank (verl's `*_per_gpu`): with Ulysses sequence parallelism
several GPUs form one DP rank. Override any key in a YAML file (nested sections) or on the command line
(`actor.ppo_mini_batch_size=16`). `posttrain explain --keys` prints the same list.
"""


def _type_name(hint: typing.Any) -> str:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if type(None) in args:  # `X | None`: a "|" would split the markdown table cell
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + " or null"
    if origin is dict:
        return "mapping NAME -> value"
    if origin is list:
        return f"list[{typing.get_args(hint)[0].__name__}]"
    return getattr(hint, "__name__", str(hint))


def render_config_reference() -> str:
    lines = [HEADER]
    defaults = PostTrainConfig()
    for section in dataclasses.fields(PostTrainConfig):
        cls = typing.get_type_hints(PostTrainConfig)[section.name]
        _render_section(lines, section.name, cls, getattr(defaults, section.name))
    return "\n".join(lines) + "\n"


def _render_section(lines: list[str], prefix: str, cls: type, defaults: typing.Any) -> None:
    """One table per section; defaults are read from a default instance (sections may override them)."""
    lines.append(f"## `{prefix}`\n\n{(cls.__doc__ or '').strip()}\n")
    lines.append("| key | type | default | unit | meaning |")
    lines.append("|---|---|---|---|---|")
    nested = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            nested.append((key, hint, getattr(defaults, f.name)))
            continue
        field, _ = field_info(key)
        meta = field.metadata
        text = meta.get("help", "")
        if meta.get("choices"):
            text += (
                " One of: " + ", ".join("`null`" if c is None else f"`{c}`" for c in meta["choices"]) + "."
            )
        default = getattr(defaults, f.name)
        default = "null" if default is None else repr(default)
        lines.append(f"| `{key}` | {_type_name(hint)} | `{default}` | {meta.get('unit', '')} | {text} |")
    lines.append("")
    for key, hint, sub in nested:
        _render_section(lines, key, hint, sub)


if __name__ == "__main__":
    print(render_config_reference(), end="")
