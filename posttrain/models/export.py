"""The exported policy: a Hugging Face model directory (or a PEFT LoRA adapter) for use outside posttrain,
published whole (written beside its place, then renamed: posttrain.utils.storage.atomic_dir)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save_file
from torch import nn

from posttrain.models.hf import load_causal_lm, save_hf
from posttrain.models.lora import adapter_state, hf_model, is_lora_model, merged_state, policy_weights
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


class GatheredExport(NamedTuple):
    """How a sharded policy is exported: the model directory it was loaded from (the plain copy rank 0 fills),
    model.dtype, trainer.export_merged, and whether this rank writes."""

    model_path: Path
    dtype: str
    merge: bool
    is_main: bool


def export_gathered_policy(
    policy: nn.Module, tokenizer, path: str | Path, how: GatheredExport
) -> tuple[Path, str]:
    """:func:`export_policy` of a policy sharded over several ranks (every rank calls it: the gathers are
    collectives): the full (merged) weights, or for a LoRA adapter export the adapter tensors alone, are gathered
    and rank 0 writes them, the full weights into a plain copy of the model read from disk."""
    path = Path(path)
    if is_lora_model(policy) and not how.merge:
        adapters = {name: t.detach().cpu().contiguous() for name, t in adapter_state(policy)}
        if how.is_main:
            with atomic_dir(path, "the exported model") as tmp:
                policy.peft_config["default"].save_pretrained(tmp)
                save_file(adapters, str(tmp / "adapter_model.safetensors"))
                tokenizer.save_pretrained(tmp)
        return path, "a PEFT LoRA adapter; loads with peft.PeftModel.from_pretrained(base_model, path)"
    state = {name: t.detach().cpu() for name, t in policy_weights(policy)}  # a collective: every rank gathers
    if how.is_main:
        model = load_causal_lm(how.model_path, how.dtype, torch.device("cpu"))
        model.load_state_dict(state, strict=False)  # tied weights may appear under one name only
        with atomic_dir(path, "the exported model") as tmp:
            save_hf(model, tokenizer, tmp)
    lora = "LoRA merged into the base weights; " if is_lora_model(policy) else ""
    return path, lora + "loads with AutoModelForCausalLM"
