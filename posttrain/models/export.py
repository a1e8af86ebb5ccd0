"""The exported policy: a Hugging Face model directory (or a PEFT LoRA adapter) for use outside posttrain,
published whole (written beside its place, then renamed: posttrain.utils.storage.atomic_dir)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from posttrain.models.hf import save_hf
from posttrain.models.lora import hf_model, is_lora_model, merged_state
from posttrain.utils.storage import atomic_dir


def export_policy(model: nn.Module, tokenizer, path: str | Path, merge: bool = False) -> tuple[Path, str]:
    """Save the policy for use outside posttrain; returns (directory, how to load it).

    Without LoRA, or with ``merge``: a plain Hugging Face model directory (``AutoModelForCausalLM``); the merged
    weights come from :func:`merged_state` (the training model is not modified). With LoRA and no merge: the PEFT
    adapter (adapter_config.json + adapter_model.safetensors) for ``PeftModel.from_pretrained(base, path)``.
    The tokenizer is saved alongside either way. ``path`` appears only once every file is written; a full or
    read-only disk is a StorageError naming it.
    """
    path = Path(path)
    with atomic_dir(path, "the exported model") as tmp:
        if not is_lora_model(model):
            save_hf(model, tokenizer, tmp)
            return path, "loads with AutoModelForCausalLM"
        if merge:
            hf_model(model).save_pretrained(tmp, state_dict=dict(merged_state(model)))
            how = "LoRA merged into the base weights; loads with AutoModelForCausalLM"
        else:
            model.save_pretrained(tmp)
            how = "a PEFT LoRA adapter; loads with peft.PeftModel.from_pretrained(base_model, path)"
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return path, how
