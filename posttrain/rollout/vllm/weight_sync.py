"""Weight push into a vLLM engine: Hugging Face-named tensors grouped by the fused tensors vLLM stores, packed into
size-bounded buckets, each loaded through the worker's in-place reload.

vLLM fuses some checkpoint tensors into one: a layer's q/k/v projections become one ``qkv_proj``, gate and up
become ``gate_up_proj``, and a tied LM head shares the embedding. Loading only part of such a tensor (q without
k and v) leaves the rest stale or uninitialised and the outputs are silently wrong, so a push here is made of
whole groups: a group never straddles two buckets, and a group missing a member is never pushed (an error says
which members are missing).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

# Checkpoint names of the members that vLLM fuses, per module: "<prefix>.<member>_proj.<leaf>".
_FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
_FUSED_MEMBERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
TIED_GROUP = "<tied embed_tokens + lm_head>"
_LAYER = re.compile(r"\.layers\.(\d+)\.")

NamedTensors = list[tuple[str, torch.Tensor]]


def checkpoint_names(model_dir: str | Path) -> set[str] | None:
    """Tensor names stored in ``model_dir``'s safetensors checkpoint (headers only, no data), or None when the
    directory holds no safetensors files (names are then checked by structure alone)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names.update(handle.keys())
    return names


def group_key(name: str, tied: bool) -> str:
    """The vLLM tensor a checkpoint tensor is loaded into: the fused module for q/k/v and gate/up (one group per
    layer and leaf, i.e. weights and biases are grouped per fused module), the tied-embedding group, or the
    module itself (so a module's weight and bias travel together)."""
    if tied and (name.endswith("embed_tokens.weight") or name == "lm_head.weight"):
        return TIED_GROUP
    module, _, _leaf = name.rpartition(".")
    prefix, _, last = module.rpartition(".")
    if last in _FUSED:
        return f"{prefix}.{_FUSED[last]}"
    return module


def group_index(known: set[str], tied: bool) -> dict[str, frozenset[str]]:
    """Group key -> all checkpoint names in that group, from the checkpoint's names."""
    index: dict[str, set[str]] = {}
    for name in known:
        index.setdefault(group_key(name, tied), set()).add(name)
    if tied:  # a tied checkpoint usually omits lm_head.weight; the state_dict (what is pushed) has both
        index.setdefault(TIED_GROUP, set()).add("lm_head.weight")
    return {key: frozenset(names) for key, names in index.items()}


def expected_members(name: str, tied: bool) -> frozenset[str]:
    """All checkpoint names of ``name``'s group, by structure (when the checkpoint's names are not known)."""
    key = group_key(name, tied)
    if key == TIED_GROUP:
        embed = name if name.endswith("embed_tokens.weight") else "model.embed_tokens.weight"
        return frozenset({embed, "lm_head.weight"})
    module, _, leaf = name.rpartition(".")
    prefix, _, last = module.rpartition(".")
    if last in _FUSED:
        return frozenset(f"{prefix}.{m}.{leaf}" for m in _FUSED_MEMBERS[_FUSED[last]])
    return frozenset({name})


def _layer_of(name: str) -> int | None:
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    tied: bool,
    known: set[str] | None = None,
    layered: bool = False,
) -> Iterator[NamedTensors]:
    """Yield buckets (lists of (name, tensor)) of whole groups, each at most ``bucket_bytes`` unless one group alone
    is larger (it then travels alone). Streams: a bucket is yielded as soon as it is full, so the caller can
    push it while the trainer produces (or gathers) the next tensors.

    tied: the model ties lm_head to embed_tokens (both must be given together).
    known: the checkpoint's names; a name outside them raises ValueError (None: no check).
    layered: also close a bucket whenever the decoder layer changes (one layer per bucket at most).
    Raises ValueError for an unknown or repeated name, and, at the end of the stream, for any group with
    members missing; that group is never yielded (the complete groups before it were).
    """
    index = group_index(known, tied) if known is not None else None
    pending: dict[str, dict[str, torch.Tensor]] = {}
    need: dict[str, frozenset[str]] = {}
    seen: set[str] = set()
    bucket: NamedTensors = []
    size, layer = 0, None
    for name, tensor in named_tensors:
        _check_name(name, known, tied, seen)
        seen.add(name)
        key = group_key(name, tied)
        if index is None and key.endswith(tuple(_FUSED_MEMBERS)):
            key += "." + name.rpartition(".")[2]  # by structure: weights and biases are separate groups
        if key not in need:
            need[key] = index[key] if index is not None else expected_members(name, tied)
        pending.setdefault(key, {})[name] = tensor
        if set(pending[key]) != need[key]:
            continue
        group = list(pending.pop(key).items())
        group_size = sum(t.numel() * t.element_size() for _, t in group)
        group_layer = _layer_of(group[0][0])
        new_layer = layered and bucket and group_layer != layer
        if bucket and (size + group_size > bucket_bytes or new_layer):
            yield bucket
            bucket, size = [], 0
        bucket.extend(group)
        size += group_size
        layer = group_layer
    if pending:
        raise ValueError(_missing_message(pending, need))
    if bucket:
        yield bucket


def _check_name(name: str, known: set[str] | None, tied: bool, seen: set[str]) -> None:
    """ValueError for a name outside the checkpoint's (when ``known`` is given) or one already ``seen``."""
    if known is not None and name not in known and not (tied and name == "lm_head.weight"):
        example = sorted(known)[0] if known else "?"
        hint = (
            (
                " (LoRA adapter tensors go through lora_sync.sync_policy(..., merge=False), which saves the "
                "adapter for vLLM to load)"
            )
            if "lora_" in name
            else ""
        )
        raise ValueError(
            f"sync_weights got {name!r}, which is not a tensor of the engine's checkpoint; "
            f"names must be Hugging Face state_dict keys such as {example!r}{hint}"
        )
    if name in seen:
        raise ValueError(f"sync_weights got {name!r} twice in one call; give each tensor once")


def _missing_message(pending: dict[str, dict[str, torch.Tensor]], need: dict[str, frozenset[str]]) -> str:
    lines = [
        f"{key}: got {sorted(got)}, missing {sorted(need[key] - set(got))}"
        for key, got in sorted(pending.items())
    ]
    return (
        "sync_weights was given part of a fused group, which vLLM stores as one tensor (loading part of it gives "
        "silently wrong outputs), so that group was not loaded: "
        + "; ".join(lines)
        + ". Give every member of "
        "a group in the same call (q/k/v of a layer, gate/up of a layer, a module's weight and bias, and both "
        "embed_tokens and lm_head when they are tied), e.g. the whole state_dict; complete groups given before "
        "it in this call were loaded."
    )


def reload_on_worker(worker, items: NamedTensors) -> list[str]:
    """Runs inside each vLLM worker (``LLM.collective_rpc``): load ``items`` in place, in checkpoint format (vLLM
    fuses, shards and repacks them as at start-up). Returns the names loaded. Module-level so that it pickles
    when vLLM runs its workers in other processes."""
    worker.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)
    return [name for name, _ in items]
