"""The tool config file (YAML or JSON): which functions are tools, by path, with optional explicit schemas.

```yaml
tools:
  - path: my_tools.py:calculator        # a file (relative to this config file, then to the working directory)
  - path: mypkg.search:web_search       # or an importable module
    timeout_s: 10                       # optional, overrides the run's per-call timeout
    schema:                             # optional: as verl's tool YAML (`tool_schema` is accepted too)
      type: function
      function: {name: web_search, description: ..., parameters: {...}}
```

verl's tool YAML reads the same: ``class_name: pkg.module.function`` stands for ``path: pkg.module:function``
(``pkg/module.py`` beside the config file first, as a ``path:``) and ``config: {type: native}`` is accepted
(posttrain tools are plain functions: a verl ``BaseTool`` class, or any other ``config`` setting, is a ConfigError
saying so). verl's own tools by their class names are served by posttrain's implementations (:data:`VERL_TOOLS`):
``Gsm8kTool`` by the GSM8K answer check, ``SandboxFusionTool`` by the python tool in the run's sandbox.

Every mistake (a missing or unreadable file, a missing function, a schema that does not fit the signature) is a
ConfigError naming the config file, the tool and the fix, raised before any model loads.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import yaml

from posttrain.agents.gsm8k_tool import calc_gsm8k_reward
from posttrain.agents.python_tool import python
from posttrain.agents.tools import Tool, ToolSet, make_tool
from posttrain.config.errors import ConfigError, MissingPathError
from posttrain.utils.user_code import function_of, import_file

_KEYS = {"path", "class_name", "config", "schema", "tool_schema", "timeout_s"}

log = logging.getLogger("posttrain")

# verl's tool classes (its current and its older module paths) and posttrain's own implementation of each.
VERL_TOOLS = {
    "verl.tools.gsm8k_tool.Gsm8kTool": calc_gsm8k_reward,
    "verl.workers.tool.gsm8k_tool.Gsm8kTool": calc_gsm8k_reward,
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": python,
}
# verl's SandboxFusionTool settings that the run's sandbox (the `sandbox` section) decides instead.
SANDBOX_FUSION_SETTINGS = (
    "sandbox_fusion_url",
    "num_workers",
    "enable_global_rate_limit",
    "rate_limit",
    "memory_limit_mb",
)


def load_tool_config(path: str | Path) -> ToolSet:
    """The tools a config file names (see the module docstring for the format)."""
    path = Path(path)
    if not path.is_file():
        raise MissingPathError(
            f"tool config {str(path)!r} not found; check rollout.multi_turn.tool_config_path"
        )
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"tool config {str(path)!r} cannot be read: {_one_line(exc)}; fix the file's syntax"
        ) from exc
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(
            f"tool config {str(path)!r}: expected a top-level 'tools' list (each item `path: file.py:function`)"
        )
    return ToolSet([_load_entry(entry, i, path) for i, entry in enumerate(entries)])


def _one_line(exc: Exception) -> str:
    """A parser error in one line: YAML's own messages span several (the problem, then a caret drawing)."""
    mark = getattr(exc, "problem_mark", None)
    if isinstance(exc, yaml.YAMLError) and mark is not None:
        return f"{getattr(exc, 'problem', None) or type(exc).__name__} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


def _load_entry(entry: Any, index: int, config: Path) -> Tool:
    where = f"tool config {str(config)!r}, tools[{index}]"
    if isinstance(entry, dict) and "path" not in entry and entry.get("class_name") in VERL_TOOLS:
        return _verl_tool(entry, f"{where} ({entry['class_name']})")
    if isinstance(entry, dict) and "path" not in entry and isinstance(entry.get("class_name"), str):
        entry = {
            **{k: v for k, v in entry.items() if k != "class_name"},
            "path": _verl_class_name(entry["class_name"], config.parent),
        }
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        raise ConfigError(f"{where}: each tool needs `path: file.py:function` (or `package.module:function`)")
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; allowed: {sorted(_KEYS)}")
    spec = entry["path"]
    where = f"{where} ({spec})"
    settings = entry.get("config") or {}
    if not isinstance(settings, dict) or {k: v for k, v in settings.items() if (k, v) != ("type", "native")}:
        raise ConfigError(
            f"{where}: config={settings!r} is not supported: posttrain tools are plain functions without "
            "settings (verl's `config: {type: native}` is accepted); drop it or bind the settings in the function"
        )
    fn = resolve_function(spec, config.parent, where)
    if isinstance(fn, type):
        raise ConfigError(
            f"{where}: {spec!r} is a class (verl's BaseTool?); posttrain tools are functions whose type hints and "
            "docstring give the schema: wrap the class's execute() in a function and name that"
        )
    schema = entry.get("schema", entry.get("tool_schema"))
    timeout = entry.get("timeout_s")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ConfigError(f"{where}: timeout_s={timeout!r} must be a positive number of seconds")
    return make_tool(fn, schema=schema, timeout_s=timeout, where=where)


def _verl_class_name(name: str, base: Path) -> str:
    """verl writes ``pkg.module.Name``; we read ``pkg/module.py:Name`` when that file is beside the config (as a
    ``path:`` is looked up), else ``pkg.module:Name`` (a ``file.py:name`` passes unchanged)."""
    if ":" in name or "." not in name:
        return name
    module, _, attr = name.rpartition(".")
    file = module.replace(".", "/") + ".py"
    return f"{file}:{attr}" if (base / file).is_file() else f"{module}:{attr}"


def _verl_tool(entry: dict[str, Any], where: str) -> Tool:
    """verl's own tool by its class name, served by posttrain's implementation under the config's schema.
    SandboxFusionTool's settings: ``default_timeout`` is the call's timeout, ``default_language`` must be
    python, the others belong to the run's sandbox (said in one warning line)."""
    unknown = sorted(set(entry) - _KEYS - {"path"})
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; allowed: {sorted(_KEYS)}")
    fn = VERL_TOOLS[entry["class_name"]]
    settings = dict(entry.get("config") or {})
    settings.pop("type", None)  # verl's native tool type: posttrain's tools are all native
    timeout = entry.get("timeout_s")
    if fn is python:
        timeout = timeout if timeout is not None else settings.pop("default_timeout", None)
        language = str(settings.pop("default_language", "python")).lower()
        if language != "python":
            raise ConfigError(
                f"{where}: default_language={language!r}: posttrain's code tool runs Python only"
            )
        ignored = sorted(k for k in settings if k in SANDBOX_FUSION_SETTINGS)
        if ignored:
            log.warning(
                "%s: verl's %s ignored: the code runs in the run's sandbox (the `sandbox` section; a SandboxFusion "
                "server: sandbox.backend=sandbox_fusion, sandbox.sandbox_fusion.url; sandbox.max_concurrent, "
                "sandbox.memory_limit_mb)",
                where,
                ", ".join(ignored),
            )
        settings = {k: v for k, v in settings.items() if k not in SANDBOX_FUSION_SETTINGS}
    if settings:
        raise ConfigError(
            f"{where}: config {settings!r} is not supported by posttrain's {fn.__name__} tool; drop it"
        )
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ConfigError(f"{where}: timeout={timeout!r} must be a positive number of seconds")
    schema = entry.get("schema", entry.get("tool_schema"))
    return make_tool(fn, schema=schema, timeout_s=timeout, where=where)


def resolve_function(spec: str, base: Path, where: str) -> Any:
    """The object ``file.py:name`` or ``package.module:name`` names (a file is looked up beside ``base`` first)."""
    if ":" not in spec:
        raise ConfigError(
            f"{where}: {spec!r} must be 'path/to/file.py:function' or 'package.module:function'"
        )
    target, name = spec.rsplit(":", 1)
    if target.endswith(".py"):
        candidates = [base / target, Path(target)]
        file = next((c for c in candidates if c.is_file()), None)
        if file is None:
            raise ConfigError(
                f"{where}: file {target!r} not found (looked beside the config and in the working directory)"
            )
        module = import_file(file, where)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ConfigError(
                f"{where}: cannot import module {target!r}: {exc}; is it installed or on PYTHONPATH?"
            ) from exc
    return function_of(module, name, where, what="callables")
