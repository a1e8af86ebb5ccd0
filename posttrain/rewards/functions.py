"""Rule-based reward functions and how a config names one.

Every reward function has the signature::

    fn(prompt: str, response: str, ground_truth: str | None, extra: dict) -> float

``extra`` is the record's other fields (``PromptRecord.extra``). A config names a built-in by its key in
:data:`REWARD_FUNCTIONS` or a user function as ``path/to/file.py:fn_name``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.config.errors import ConfigError
from posttrain.data.tasks.arithmetic import arithmetic_reward
from posttrain.data.tasks.gsm8k import gsm8k_reward

RewardFn = Callable[[str, str, "str | None", dict[str, Any]], float]


def exact_match_reward(prompt: str, response: str, ground_truth: str | None, extra: dict[str, Any]) -> float:
    """1.0 when ``response`` equals ``ground_truth`` after stripping surrounding whitespace, else 0.0."""
    if ground_truth is None:
        raise ConfigError("the exact_match reward needs a ground_truth answer; the record has none")
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "exact_match": exact_match_reward,
    "arithmetic": arithmetic_reward,
    "gsm8k": gsm8k_reward,
}


def resolve_reward_function(spec: str | RewardFn) -> RewardFn:
    """The reward function named by ``spec``: a key of :data:`REWARD_FUNCTIONS` or ``file.py:fn_name``.

    A callable is returned unchanged, so code may pass a function directly.
    """
    if callable(spec):
        return spec
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    if ":" not in spec:
        raise ConfigError(
            f"reward function {spec!r} is neither a built-in ({sorted(REWARD_FUNCTIONS)}) "
            "nor a user function written as 'path/to/file.py:function_name'"
        )
    # rsplit: the path part may itself contain ':' (a Windows drive letter).
    file_part, fn_name = spec.rsplit(":", 1)
    module = _load_module(Path(file_part), spec)
    if not hasattr(module, fn_name):
        callables = sorted(
            name
            for name, value in vars(module).items()
            if callable(value)
            and not name.startswith("_")
            and getattr(value, "__module__", None) == module.__name__
        )
        raise ConfigError(
            f"reward function {spec!r}: {file_part} defines no {fn_name!r}; functions defined there: {callables}"
        )
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise ConfigError(f"reward function {spec!r}: {fn_name!r} is a {type(fn).__name__}, not a function")
    _check_signature(fn, spec)
    return fn


def _load_module(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise ConfigError(f"reward function {spec!r}: file {str(path)!r} not found")
    resolved = path.resolve()
    # A unique, stable module name per file, registered in sys.modules so that dataclasses, pickling
    # and repeated resolution of the same file behave as for a normal import.
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    name = f"posttrain_user_reward_{resolved.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"reward function {spec!r}: cannot import {str(path)!r}; is it a .py file?")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ConfigError(f"reward function {spec!r}: importing {str(path)!r} failed: {exc!r}") from exc
    return module


def _check_signature(fn: Callable[..., Any], spec: str) -> None:
    """Fail at start-up, not mid-run, when ``fn`` cannot take the four reward arguments."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some builtins have no introspectable signature; the call itself will tell
    try:
        signature.bind("prompt", "response", "ground_truth", {})
    except TypeError as exc:
        raise ConfigError(
            f"reward function {spec!r} has signature {signature}; it must accept "
            "(prompt, response, ground_truth, extra)"
        ) from exc
