"""Model preparation from the config: checks of the policy's switches before any weights load, then
gradient checkpointing and Liger applied to a loaded module from outside (the model code stays plain)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, Qwen2Config

from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.models.lora import check_lora_config, hf_model
from posttrain.models.registry import check_packing_supported
from posttrain.utils.console import warn_once


def read_model_config(path: str):
    """The Hugging Face config of a model directory without loading weights (None when there is none:
    the model loader reports that). The built-in models (``builtin:tiny``, ``builtin:base``) are tiny Qwen2s."""
    if path.startswith("builtin:"):
        return Qwen2Config()  # posttrain.models.tiny builds a Qwen2; only model_type and the head matter here
    if not (Path(path) / "config.json").is_file():
        return None
    return AutoConfig.from_pretrained(path, local_files_only=True)


def check_packing(key: str, model_config) -> None:
    """ValueError naming ``key`` when the architecture is not verified for packed forwards."""
    try:
        check_packing_supported(model_config)
    except ValueError as err:
        raise ConfigError(f"{key}=true: {err}") from None


def warn_offload_on_cpu(key: str, device: torch.device) -> None:
    """Activation offload moves activations from GPU to CPU memory; on CPU there is nothing to move (warned once)."""
    if device.type != "cuda":
        warn_once(
            key,
            f"{key}=true has no effect on {device.type}: activations already live in CPU memory "
            "(it moves them off a CUDA device). Set it to false to silence this warning.",
            RuntimeWarning,
            stacklevel=3,
        )


def check_liger(device: torch.device, model_config) -> None:
    """ValueError naming model.use_liger and what is missing (a CUDA device, liger-kernel, a supported model)."""
    missing = []
    if device.type != "cuda":
        missing.append(
            f"a CUDA device (the run is on {device.type}; Liger's Triton kernels cannot run on CPU)"
        )
    if importlib.util.find_spec("liger_kernel") is None:
        missing.append("the liger-kernel package (pip install liger-kernel)")
    if missing:
        raise ConfigError(f"model.use_liger=true needs {' and '.join(missing)}; set model.use_liger=false")
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = getattr(model_config, "model_type", None)
    if model_config is not None and model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ConfigError(
            f"model.use_liger=true: liger-kernel has no kernels for model_type={model_type!r} (supported: "
            f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); set model.use_liger=false"
        )


def check_policy_switches(cfg: PostTrainConfig, device: torch.device, model_config) -> None:
    """The policy model's switches (RL and SFT): packing support, liger, activation offload, LoRA."""
    check_lora_config(cfg, model_config)
    if cfg.model.use_remove_padding and model_config is not None:
        check_packing("model.use_remove_padding", model_config)
    if cfg.model.use_liger:
        check_liger(device, model_config)
    if cfg.model.enable_activation_offload:
        warn_offload_on_cpu("model.enable_activation_offload", device)


def enable_gradient_checkpointing(module: nn.Module) -> None:
    """Hugging Face activation checkpointing of every decoder layer, non-reentrant (works whether or not the
    inputs require grad, and composes with activation offload). Active only in training mode."""
    target = getattr(module, "backbone", module)  # a CriticModel checkpoints its Hugging Face backbone
    kwargs = {"use_reentrant": False}
    if hasattr(target, "activation_checkpointing_enable"):  # the name since transformers 5.x
        target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def apply_liger(module: nn.Module) -> None:
    """liger-kernel's Triton RoPE / RMSNorm / SwiGLU on this model instance (CUDA; checked by check_liger).

    posttrain computes log-probs from the decoder's hidden states and the LM head itself, so Liger's fused
    linear-cross-entropy forward would never run: ``model.forward`` is left unpatched (the rollout keeps the
    plain logits path).
    """
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    # Liger finds the decoder through Hugging Face attribute paths, which a PEFT wrapper resolves differently.
    _apply_liger_kernel_to_instance(
        model=hf_model(module), fused_linear_cross_entropy=False, cross_entropy=False
    )


def prepare_policy(module: nn.Module, cfg: PostTrainConfig, *, trained: bool = True) -> nn.Module:
    """Apply the policy's module-level switches (gradient checkpointing when ``trained``, liger) in place."""
    if trained and cfg.model.enable_gradient_checkpointing:
        enable_gradient_checkpointing(module)
    if cfg.model.use_liger:
        apply_liger(module)
    return module


def prepare_critic(module: nn.Module, cfg: PostTrainConfig) -> nn.Module:
    """Apply the critic's module-level switches in place."""
    if cfg.critic.enable_gradient_checkpointing:
        enable_gradient_checkpointing(module)
    return module
