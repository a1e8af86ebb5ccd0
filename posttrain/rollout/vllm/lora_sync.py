"""What a PEFT (LoRA) policy pushes into the vLLM engine: merged weights, or the adapter alone.

Merged: the base weights with ``scale * B @ A`` added, under the plain model's Hugging Face names, loaded like any
other weights (``VLLMEngine.sync_weights``): works with any engine, costs a full weight push per sync.
Adapter only: the adapter is saved with PEFT's ``save_pretrained`` into a fresh directory and vLLM serves it as a
LoRA adapter (``enable_lora``) under a new LoRA id each time; the push is the adapter's size, sampling pays for
the LoRA matmuls. The engine's base weights must then be the policy's base: from the checkpoint
(``load_format=auto``) or pushed once by :func:`sync_policy` (``load_format=dummy``).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from posttrain.models.lora import ADAPTER_NAME, hf_model, is_lora_model, merged_state, policy_weights
from posttrain.rollout.vllm.engine import VLLMEngine

_ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def base_state(policy: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of a PEFT policy's frozen base weights (adapters left out, ``.base_layer.``
    removed from names): what an adapter-serving engine holds under the adapter."""
    for name, tensor in hf_model(policy).state_dict().items():
        if any(part in _ADAPTER_PARTS for part in name.split(".")):
            continue
        yield name.replace(".base_layer.", "."), tensor


class AdapterDirs:
    """Fresh directories for saved adapters, one per sync, deleting the one before the last (vLLM may still
    read the last one when a request starts). ``root`` None makes a temporary directory."""

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="posttrain-lora-"))
        self.version = 0

    def next(self) -> Path:
        self.version += 1
        stale = self.root / f"adapter-{self.version - 2}"
        if stale.exists():
            shutil.rmtree(stale)
        return self.root / f"adapter-{self.version}"


def sync_policy(engine: VLLMEngine, policy: nn.Module, merge: bool, dirs: AdapterDirs | None = None) -> None:
    """Push ``policy`` into ``engine``: plain policy -> its state_dict; LoRA policy with ``merge`` -> merged
    weights; LoRA policy without ``merge`` -> the adapter (saved under ``dirs``; the engine needs
    ``enable_lora``), after pushing the base weights once if the engine started with dummy weights."""
    if not is_lora_model(policy):
        engine.sync_weights(policy_weights(policy))
    elif merge:
        engine.sync_weights(merged_state(policy))
    else:
        if dirs is None:
            raise ValueError("adapter-only sync needs an AdapterDirs (where adapters are saved for vLLM)")
        if engine.needs_full_sync:
            engine.sync_weights(base_state(policy))
        path = dirs.next()
        policy.save_pretrained(str(path), selected_adapters=[ADAPTER_NAME])
        engine.load_lora_adapter(path)
