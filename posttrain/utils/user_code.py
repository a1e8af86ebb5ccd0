"""Importing the user's own code: a reward function or a tool named as ``path/to/file.py:name``.

One loader for every place that names a function by file, so a file imported twice (as a reward and as a
tool, or once per worker) is the same module, and every failure reads the same way: a ConfigError that says
where the name came from (``where``), the file, and what went wrong.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from posttrain.config.errors import ConfigError


def import_file(path: Path, where: str) -> ModuleType:
    """The module of a ``.py`` file, imported once under a unique, stable name registered in sys.modules (so
    dataclasses, pickling and repeated resolution of one file behave as for a normal import)."""
    if not path.is_file():
        raise ConfigError(f"{where}: file {str(path)!r} not found")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    name = f"posttrain_user_{resolved.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{where}: cannot import {str(path)!r}; is it a .py file?")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ConfigError(f"{where}: importing {str(path)!r} failed: {exc!r}") from exc
    return module


def function_of(module: ModuleType, name: str, where: str, what: str = "functions") -> Any:
    """``module.name``, which must be callable; a missing name lists the public callables the module defines."""
    if not hasattr(module, name):
        defined = sorted(
            n
            for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        source = getattr(module, "__file__", None) or module.__name__
        raise ConfigError(f"{where}: {source} defines no {name!r}; {what} defined there: {defined}")
    obj = getattr(module, name)
    if not callable(obj):
        raise ConfigError(f"{where}: {name!r} is a {type(obj).__name__}, not a function")
    return obj
