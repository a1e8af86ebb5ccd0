"""Model and optimizer state through torch.distributed.checkpoint (DCP): sharded on save, resharded on load.

Each rank writes only its own shards (FSDP2 DTensors) to one directory; any number of ranks, one included,
can load it, because DCP records every tensor's global shape and each shard's offsets, and each loading rank
reads exactly the pieces its own layout needs. Keys are parameter names (FQNs), never parameter ids, so a
checkpoint does not depend on the world size or on how the model was wrapped.

Stored names: ``<key>.model.<parameter name>`` and ``<key>.optim.state.<parameter name>.<exp_avg|...>``
(plus ``<key>.optim.param_groups...``). Frozen parameters are not stored (see ``_OPTIONS``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

# Only trainable parameters are stored: frozen ones never change during a run and come back from model.path
# (a LoRA actor's checkpoint thus holds its adapters alone). Buffers are stored.
_OPTIONS = StateDictOptions(ignore_frozen_params=True)
# Parameters that never received a gradient have no optimizer state: loading must not invent one.
_LENIENT = StateDictOptions(ignore_frozen_params=True, strict=False)


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns that it runs "in a single process" whenever torch.distributed is not initialised: that is
    the one-rank case, by design."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*assuming the intent is to (save|load) in a single process"
        )
        yield


def _targets(modules: Mapping[str, nn.Module], optimizers: Mapping[str, Optimizer]) -> dict:
    state: dict = {}
    for key, module in modules.items():
        if key in optimizers:
            model_sd, optim_sd = get_state_dict(module, optimizers[key], options=_OPTIONS)
            state[key] = {"model": model_sd, "optim": optim_sd}
        else:
            state[key] = {"model": get_model_state_dict(module, options=_OPTIONS)}
    return state


def save_state(
    directory: Path, modules: Mapping[str, nn.Module], optimizers: Mapping[str, Optimizer]
) -> None:
    """Write every module's and optimizer's state; a collective when torch.distributed is initialised."""
    with _single_process_ok():
        dcp.save(_targets(modules, optimizers), checkpoint_id=str(directory))


def saved_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every stored tensor's name and global shape (read from DCP's metadata; no tensor data is read)."""
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    return {
        name: tuple(meta.size) for name, meta in metadata.state_dict_metadata.items() if hasattr(meta, "size")
    }


def module_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The module's state names and global shapes, as DCP stores them (sharded tensors: the full shape)."""
    return {name: tuple(t.shape) for name, t in get_model_state_dict(module, options=_OPTIONS).items()}


def load_state(
    directory: Path, modules: Mapping[str, nn.Module], optimizers: Mapping[str, Optimizer]
) -> None:
    """Load into the given modules and optimizers in place, resharding to their current layout."""
    stored = saved_shapes(directory)
    state = _targets(modules, optimizers)
    for key, entry in state.items():
        if "optim" in entry:
            prefix = f"{key}.optim.state."
            with_state = {s[len(prefix) :].rsplit(".", 1)[0] for s in stored if s.startswith(prefix)}
            entry["optim"]["state"] = {n: v for n, v in entry["optim"]["state"].items() if n in with_state}
    with _single_process_ok():
        dcp.load(state, checkpoint_id=str(directory))
    for key, module in modules.items():
        entry = state[key]
        if key in optimizers:
            set_state_dict(
                module,
                optimizers[key],
                model_state_dict=entry["model"],
                optim_state_dict=entry["optim"],
                options=_LENIENT,
            )
        else:
            set_model_state_dict(module, entry["model"], options=_LENIENT)  # names checked by the caller


def load_module_state(directory: Path, key: str, module: nn.Module) -> None:
    """Only ``key``'s model weights (e.g. the policy, for evaluation or export)."""
    load_state(directory, {key: module}, {})
