"""Build a PostTrainConfig from YAML overrides and dotted command-line overrides.

Every key is checked against the schema: unknown keys, wrong types, values outside a field's
bounds or choices are ValueErrors naming the dotted key, before any model is loaded.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
import warnings
from pathlib import Path
from typing import Any

import yaml

from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.config.validate import (
    check_config,
    check_value,
    resolve_render_tools,
    resolve_task_environment,
)
from posttrain.config.verl_keys import LAST_TRANSLATED, translate_verl_keys

_NONE_WORDS = {"null", "none", "~"}
_TRUE_WORDS = {"true", "yes", "on", "1"}
_FALSE_WORDS = {"false", "no", "off", "0"}


def all_keys(cls: type = PostTrainConfig, prefix: str = "") -> list[str]:
    """Every leaf key of the schema in dotted form, in declaration order."""
    keys: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(all_keys(hints[f.name], name + "."))
        else:
            keys.append(name)
    return keys


def dict_entry(key: str) -> tuple[str, list[str]] | None:
    """For ``env.kwargs.max_turns``: the dict knob (``env.kwargs``) and the entry's path in it (``['max_turns']``);
    None when ``key`` does not reach into a dict knob."""
    cls: Any = PostTrainConfig
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if not dataclasses.is_dataclass(cls) or part not in {f.name for f in dataclasses.fields(cls)}:
            return None
        cls = typing.get_type_hints(cls)[part]
        if typing.get_origin(cls) is dict:
            return ".".join(parts[: i + 1]), parts[i + 1 :]
    return None


def field_info(key: str) -> tuple[dataclasses.Field, Any]:
    """The dataclass field and its resolved type for a dotted leaf key."""
    cls: Any = PostTrainConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            raise ConfigError(_unknown_key_message(".".join(parts[: i + 1]), cls, ".".join(parts[:i])))
        hint = typing.get_type_hints(cls)[part]
        if i == len(parts) - 1:
            return fields[part], hint
        if not dataclasses.is_dataclass(hint):
            raise ConfigError(
                f"config key '{'.'.join(parts[: i + 1])}' is a value, not a section: '{key}' is unknown"
            )
        cls = hint
    raise AssertionError("unreachable")


def _unknown_key_message(key: str, cls: Any, prefix: str) -> str:
    here = [f"{prefix}.{f.name}" if prefix else f.name for f in dataclasses.fields(cls)]
    leaf_matches = difflib.get_close_matches(key, all_keys(), n=3, cutoff=0.6)
    local = difflib.get_close_matches(key, here, n=3, cutoff=0.5)
    # A leaf name typed under the wrong section is the commonest slip: suggest by last component too.
    tail = key.rsplit(".", 1)[-1]
    by_tail = [k for k in all_keys() if k.rsplit(".", 1)[-1] == tail]
    suggestions = list(dict.fromkeys(by_tail + leaf_matches + local))[:4]
    hint = f"; did you mean {', '.join(repr(s) for s in suggestions)}?" if suggestions else ""
    return f"unknown config key '{key}'{hint} (run `posttrain explain --keys` to list all keys)"


def coerce(key: str, value: Any, hint: Any) -> Any:
    """Convert a YAML or command-line value to the field's declared type, or raise naming the key."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is dict:
        return _coerce_dict(key, value)
    if origin in (typing.Union, types.UnionType):
        is_none = value is None or (isinstance(value, str) and value.lower() in _NONE_WORDS)
        if is_none and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return coerce(key, value, inner[0])
    if origin is list:
        if isinstance(value, str):
            text = value.strip()
            value = _parse_list(key, text) if text.startswith("[") else [v for v in text.split(",") if v]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"config key '{key}' expects a list, got {value!r}")
        return [coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE_WORDS | _FALSE_WORDS:
            return value.lower() in _TRUE_WORDS
        raise ConfigError(f"config key '{key}' expects true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}' expects an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}' expects an integer, got {value!r}")
    if hint is float:
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}' expects a number, got {value!r}")
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}' expects a number, got {value!r}")
    if hint is str:
        if isinstance(value, bool | int | float):
            return str(value)
        if not isinstance(value, str):
            raise ConfigError(f"config key '{key}' expects a string, got {value!r}")
        return value
    raise TypeError(f"unsupported type {hint!r} for config key '{key}'")


def _coerce_dict(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        value = parse_scalar(value) if value.strip() else {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(
            f"config key '{key}' expects a mapping of names to values, got {value!r}; set one entry with "
            f"{key}.NAME=VALUE (or in YAML, NAME: VALUE lines indented under '{key.rsplit('.', 1)[-1]}:')"
        )
    return copy.deepcopy(value)


def parse_scalar(text: str) -> Any:
    """A command-line value of a dict knob's entry, read as a YAML scalar (``6`` is an int, ``a`` a string)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _parse_list(key: str, text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(
            f"config key '{key}' = {text!r} is not a valid list ({problem}); write e.g. {key}=[a,b] or {key}=a,b"
        ) from None


def _check_bounds(key: str, value: Any, field: dataclasses.Field) -> None:
    meta = field.metadata
    choices, lo, hi = meta.get("choices"), meta.get("min"), meta.get("max")
    if value is None:  # an inherited key left unset (INHERITED); bounds apply to the value it takes
        return
    if choices is not None and value not in choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"config key '{key}' = {value!r} is not one of {', '.join(map(repr, choices))}{hint}"
        )
    if lo is not None and isinstance(value, int | float) and value < lo:
        raise ConfigError(f"config key '{key}' = {value!r} must be >= {lo:g} (for example {lo:g})")
    if hi is not None and isinstance(value, int | float) and value > hi:
        raise ConfigError(f"config key '{key}' = {value!r} must be <= {hi:g} (for example {hi:g})")


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping → {dotted key: value}; an empty mapping stays a (rejected) leaf."""
    flat: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            flat.update(flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def parse_overrides(items: list[str]) -> dict[str, str]:
    """`['actor.ppo_mini_batch_size=64', ...]` → {key: raw string}."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"override {item!r} is not of the form key=value (example: actor.ppo_mini_batch_size=64)"
            )
        key, value = key.strip(), value.strip()
        if key in out and out[key] != value:
            # Shell history edits often leave an old copy behind: say which one counts.
            warnings.warn(
                f"override {key} is given twice ({key}={out[key]} then {key}={value}); the last one wins: "
                f"{key}={value}",
                stacklevel=2,
            )
        out[key] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML overrides file (a mapping of sections), with errors naming the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(_missing_yaml_message(str(path)))
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file '{p}' is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping of sections, got {type(data).__name__}")
    return data


def _missing_yaml_message(word: str) -> str:
    """A positional word that is no file: when it reads like a config key, it lost its '=value'."""
    head = word.split(".")[0]
    sections = {f.name for f in dataclasses.fields(PostTrainConfig)}
    if "." in word and "/" not in word and head in sections and not word.endswith((".yaml", ".yml")):
        return (
            f"{word!r} looks like a config override missing '=value' (no file of that name exists); write "
            f"{word}=<value>, e.g. actor.ppo_mini_batch_size=16"
        )
    return f"config file '{word}' does not exist"


def build_config(
    yaml_paths: list[str | Path] | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
) -> PostTrainConfig:
    """Defaults from the schema, then each YAML file in order, then dotted overrides. Keys written with verl's
    names are translated to posttrain's, one source at a time (posttrain.config.verl_keys)."""
    values: dict[str, Any] = {}
    LAST_TRANSLATED.clear()
    for path in yaml_paths or []:
        values.update(translate_verl_keys(flatten(read_yaml(path)), is_key)[0])
    if isinstance(overrides, dict):
        values.update(translate_verl_keys(flatten(overrides), is_key)[0])
    elif overrides:
        parsed = translate_verl_keys(parse_overrides(overrides), is_key)[0]
        values.update({k: parse_scalar(v) if _is_dict_key(k) else v for k, v in parsed.items()})
    cfg = apply_values(PostTrainConfig(), values)
    resolve_render_tools(cfg, set(values))
    return cfg


def _is_dict_key(key: str) -> bool:
    return isinstance(key, str) and dict_entry(key) is not None


def is_key(key: str) -> bool:
    """Whether ``key`` is a posttrain leaf key (or an entry of a dict knob, ``env.kwargs.NAME``)."""
    if _is_dict_key(key):
        return True
    try:
        return not dataclasses.is_dataclass(field_info(key)[1])
    except ConfigError:
        return False


INHERITED = {
    "ref.log_prob_use_dynamic_bsz": "actor.use_dynamic_bsz",
    "ref.use_prefix_grouper": "actor.use_prefix_grouper",
    "critic.shuffle": "actor.shuffle",
    "distill.teacher.dtype": "model.dtype",
    "distill.teacher.log_prob_use_dynamic_bsz": "actor.use_dynamic_bsz",
    "distill.teacher.use_remove_padding": "model.use_remove_padding",
    "critic.remove_padding_max_row_tokens": "model.remove_padding_max_row_tokens",
    "reward.model.dtype": "model.dtype",
    "reward.model.remove_padding_max_row_tokens": "model.remove_padding_max_row_tokens",
    "reward.prm.dtype": "model.dtype",
}
"""Keys whose default (null) is another section's value, as verl's YAML interpolates them. They are resolved
here, once, so that every component reads only its own section."""


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _set(cfg: Any, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        cfg = getattr(cfg, part)
    setattr(cfg, leaf, value)


def prefix_grouper_by_default(cfg: PostTrainConfig) -> bool:
    """What ``actor.use_prefix_grouper: null`` means: on where it is exact and saves work, i.e. with several
    samples per prompt, no Ulysses SP (it works on whole sequences) and no packing (``model.use_remove_padding``
    chooses packed rows, with flash-attention's varlen kernel on GPUs, which takes no per-sequence mask)."""
    return (
        cfg.rollout.n > 1
        and cfg.actor.ulysses_sequence_parallel_size == 1
        and not cfg.model.use_remove_padding
    )


def resolve_inherited(cfg: PostTrainConfig) -> PostTrainConfig:
    """Fill each unset (null) key of :data:`INHERITED` with its source key's value, in place (after the
    automatic ones: ``actor.use_prefix_grouper``)."""
    if cfg.actor.use_prefix_grouper is None:
        cfg.actor.use_prefix_grouper = prefix_grouper_by_default(cfg)
    for key, source in INHERITED.items():
        if _get(cfg, key) is None:
            _set(cfg, key, _get(cfg, source))
    return cfg


def apply_values(cfg: PostTrainConfig, values: dict[str, Any]) -> PostTrainConfig:
    """Return a copy of cfg with dotted values applied (cfg itself is never mutated); inherited keys left
    unset take their source's value."""
    cfg = _deep_copy(cfg)
    for key, raw in values.items():
        entry = dict_entry(key)
        if entry is not None:
            _set_entry(cfg, key, entry, raw)
            continue
        field, hint = field_info(key)
        if dataclasses.is_dataclass(hint):
            raise ConfigError(_section_value_message(key, raw, hint))
        value = coerce(key, raw, hint)
        _check_bounds(key, value, field)
        check_value(key, value)
        _set(cfg, key, value)
    cfg = resolve_inherited(cfg)
    resolve_task_environment(cfg, set(values))
    check_config(cfg)
    return cfg


def _set_entry(cfg: PostTrainConfig, key: str, entry: tuple[str, list[str]], raw: Any) -> None:
    """``env.kwargs.a.b = v``: set ``v`` at ``['a']['b']`` of the dict knob ``env.kwargs``."""
    knob_key, path = entry
    if not all(path):
        raise ConfigError(
            f"config key '{key}' has an empty name after '{knob_key}.'; write {knob_key}.NAME=VALUE"
        )
    target = _get(cfg, knob_key)
    for part in path[:-1]:
        if not isinstance(target.get(part), dict):
            target[part] = {}
        target = target[part]
    target[path[-1]] = copy.deepcopy(raw)


def _section_value_message(key: str, raw: Any, section: type) -> str:
    """`data=5`, YAML `actor: {optim: 5}` or a list under `data:` give a section a value: name its keys."""
    keys = all_keys(section, key + ".")
    shown = ", ".join(keys[:4]) + (", ..." if len(keys) > 4 else "")
    return (
        f"config key '{key}' is a section, not a value, but it was given {raw!r} "
        f"({type(raw).__name__}); set its keys instead ({shown}), e.g. {keys[0]}=<value> on the command line "
        f"or '{key.split('.')[0]}:' followed by indented 'key: value' lines in YAML"
    )


def _deep_copy(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(
            obj, **{f.name: _deep_copy(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        )
    if isinstance(obj, list):
        return list(obj)
    if isinstance(obj, dict):
        return copy.deepcopy(obj)
    return obj


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as a plain nested dict (for YAML dumps and run directories)."""
    return dataclasses.asdict(cfg)


def diff_from_defaults(cfg: PostTrainConfig) -> dict[str, Any]:
    """Dotted keys whose value differs from the schema default."""
    ours, base = flatten(to_dict(cfg)), flatten(to_dict(resolve_inherited(PostTrainConfig())))
    return {k: v for k, v in ours.items() if base.get(k) != v}
