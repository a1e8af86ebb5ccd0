"""model.path resolved to the directory a run loads: a built-in model, a local directory or a Hub id.

Two built-in names:
- ``builtin:tiny``: the arithmetic demo's model, warm-started on the generated task. It is refused when the
  config names the user's own data files: the demo's warm start (imperfect arithmetic demonstrations)
  means nothing on another task, and training on it silently would hide that.
- ``builtin:base``: the same tiny model and tokenizer, untrained (random weights from trainer.seed): the
  starting point for a user's own SFT (docs/your-task.md).

Both directories are cached (keyed by everything that shapes them and nothing else), so only the first
run pays for building them. Set POSTTRAIN_CACHE to move the cache (default ~/.cache/posttrain). Builds go
to ``.tmp-<name>-<pid>`` and are renamed when complete; leftovers of a process that died mid-build are
removed by the next build.

The warm start trains with SFT, which sits above this package: a caller that may meet ``builtin:tiny``
hands its builder in (``posttrain.sft.builtin:builtin_model_dir``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import yaml

from posttrain.config.errors import ConfigError, MissingPathError
from posttrain.config.schema import PostTrainConfig
from posttrain.models.hub import looks_like_hub_id, resolve_hub_model
from posttrain.models.tiny import create_tiny_model_dir

# Version the recipe: bump when the tiny model, its tokenizer or the warm start change.
RECIPE_VERSION = 3  # 3: the forward narrows the last MLP (float rounding moved the warm start)
BUILTIN_NAMES = ("builtin:tiny", "builtin:base")

# Builds the warm-started builtin:tiny directory for a config (cfg, quiet) -> its directory.
WarmStart = Callable[[PostTrainConfig, bool], Path]


def cache_root() -> Path:
    return Path(os.environ.get("POSTTRAIN_CACHE", Path.home() / ".cache" / "posttrain"))


def cache_key(payload: dict) -> str:
    """A short, stable name for what shapes a cached model."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by someone else
    return True


def remove_stale_builds(root: Path) -> list[Path]:
    """Delete ``.tmp-*-<pid>`` build folders whose process is gone (a killed or crashed build)."""
    removed = []
    for tmp in root.glob(".tmp-*") if root.is_dir() else []:
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def atomic_build(target: Path, build: Callable[[Path], None]) -> Path:
    """Build into a temporary sibling, then rename: an interrupted build never looks complete."""
    if (target / "config.json").exists():
        return target
    remove_stale_builds(target.parent)
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
    except BaseException:  # a signal or an error: nothing half-built is left for the next run to sweep
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():  # a concurrent build finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return target
    os.replace(tmp, target)
    return target


def builtin_base_dir(cfg: PostTrainConfig) -> Path:
    """The untrained tiny model + tokenizer for trainer.seed."""
    seed = cfg.trainer.seed
    target = cache_root() / f"tiny-base-v{RECIPE_VERSION}-seed{seed}"
    return atomic_build(target, lambda tmp: create_tiny_model_dir(tmp, seed=seed))


def user_data_keys(cfg: PostTrainConfig) -> list[str]:
    """The config keys that name the user's own data files (empty: the built-in task)."""
    keys = [("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)]
    keys.append(("sft.train_files", cfg.sft.train_files))
    return [f"{k}={v}" for k, v in keys if v]


def check_builtin_choice(cfg: PostTrainConfig) -> None:
    """builtin:tiny is the arithmetic demo's warm-started model: refuse it on the user's own data."""
    path = cfg.model.path
    if path.startswith("builtin:") and path not in BUILTIN_NAMES:
        raise ConfigError(f"model.path={path!r} is not a built-in model; use one of {list(BUILTIN_NAMES)}")
    given = user_data_keys(cfg)
    if path == "builtin:tiny" and given:
        raise ConfigError(
            f"model.path=builtin:tiny is the arithmetic demo's model, warm-started on imperfect arithmetic "
            f"demonstrations, but the config names your own data ({', '.join(given)}). Use "
            "model.path=builtin:base (the same tiny model, untrained; fine-tune it with `posttrain sft` first, "
            "see docs/your-task.md) or your own model directory or Hub id"
        )


def resolve_model_path(cfg: PostTrainConfig, quiet: bool = False, *, warm_start: WarmStart | None) -> Path:
    """The model directory a run uses: the built-in models ('builtin:tiny', 'builtin:base'), a local
    directory, or a Hugging Face Hub id (from the local cache, downloaded when not there and online).

    `warm_start` builds builtin:tiny; None only where the caller has ruled builtin:tiny out."""
    check_builtin_choice(cfg)
    if cfg.model.path == "builtin:tiny":
        if warm_start is None:
            raise ValueError("resolve_model_path met builtin:tiny but was given no warm_start to build it")
        return warm_start(cfg, quiet)
    if cfg.model.path == "builtin:base":
        return builtin_base_dir(cfg)
    path = Path(cfg.model.path)
    if not path.exists() and looks_like_hub_id(cfg.model.path):
        return resolve_hub_model(cfg.model.path)
    if not (path / "config.json").exists():
        raise MissingPathError(
            f"model.path={cfg.model.path!r} is not a Hugging Face model directory (no config.json) nor a Hub "
            "id ('org/name'); give a local directory saved with save_pretrained, a Hub id, "
            "model.path=builtin:base (untrained tiny model) or builtin:tiny (the arithmetic demo)"
        )
    return path


def write_run_info(run_dir: Path, cfg: PostTrainConfig, model_path: Path) -> Path:
    """run_info.yaml: which model directory a run used (model.path as given, and what it resolved to)."""
    info = {"model_path": cfg.model.path, "resolved_model_path": str(Path(model_path).resolve())}
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "run_info.yaml"
    path.write_text(yaml.safe_dump(info, sort_keys=False))
    return path
