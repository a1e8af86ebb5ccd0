"""model.path as transformers reads it: a local directory, or a Hugging Face Hub id ("Qwen/Qwen2.5-0.5B-Instruct").

A Hub id resolves to its snapshot in the local Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub, else
~/.cache/huggingface/hub); when it is not cached and the Hub may be reached (HF_HUB_OFFLINE unset) it is
downloaded there first, as ``from_pretrained`` would. Everything downstream then loads a plain directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from huggingface_hub import snapshot_download, try_to_load_from_cache

from posttrain.config.errors import ConfigError

# "org/name" or "name", as the Hub spells repository ids; a local path that exists always wins.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def hub_cache_dir() -> Path:
    """Read at call time (not at import, as huggingface_hub does) so a test or a wrapper may set it late."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home) / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def looks_like_hub_id(path: str) -> bool:
    return "/" in path and not Path(path).exists() and bool(_HUB_ID.match(path)) and not path.startswith(".")


def cached_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot directory of ``repo_id`` (its ``refs/main``), or None when it is not cached."""
    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=str(hub_cache_dir()))
    return Path(found).parent if isinstance(found, str) else None


def resolve_hub_model(repo_id: str, download: bool = True) -> Path | None:
    """The local directory of Hub model ``repo_id``: cached, else downloaded (``download`` and online).

    Returns None when it is not cached and ``download`` is False (a pre-flight check that must not download).
    """
    snapshot = cached_snapshot(repo_id)
    if snapshot is not None:
        return snapshot
    if hub_offline():
        raise ConfigError(
            f"model.path={repo_id!r} is a Hub id that is not in the local Hugging Face cache ({hub_cache_dir()}) "
            "and HF_HUB_OFFLINE is set; download it where there is network (huggingface-cli download "
            f"{repo_id}), or give a local model directory"
        )
    if not download:
        return None
    try:
        return Path(snapshot_download(repo_id, cache_dir=str(hub_cache_dir())))
    except Exception as exc:  # network, auth or a wrong id: the user's to fix, one message
        raise ConfigError(
            f"model.path={repo_id!r}: could not download it from the Hugging Face Hub ({exc}); check the id, "
            "the network and HF_TOKEN, or give a local model directory"
        ) from exc
