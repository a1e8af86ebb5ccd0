"""Where the throughput and memory switches act: config keys → forward options and module preparation.

Every key is read here and nowhere else in the trainers (docs/throughput.md explains when to use each):

==========================================  ====================================================================
key                                         acts as
==========================================  ====================================================================
model.use_remove_padding,                   ``ForwardOptions.remove_padding`` of the actor, old-log-prob,
model.remove_padding_max_row_tokens         reference and SFT passes (packing in ``posttrain.models.forward``);
                                            the architecture is checked before any weights load; flash-attention
                                            is loaded on CUDA when ``flash_attn`` is installed (one row per
                                            micro-batch)
critic.use_remove_padding                   the same for the critic update and the values pass
actor.use_prefix_grouper                    ``ForwardOptions.prefix_grouper`` of the actor update, old-log-prob
                                            and reference passes (``posttrain.models.prefix_grouper``); the
                                            policy then loads with sdpa (a 4-D mask); refused with Ulysses SP
                                            and sliding-window attention
actor.entropy_from_logits_with_chunking,    ``ForwardOptions.logprob_chunk_size`` / ``chunk_checkpoint`` of the
actor.entropy_from_logits_chunk_size,       actor update and the old-log-prob pass (the chunked head,
actor.entropy_checkpointing                 ``posttrain.models.chunked_head``)
ref.entropy_from_logits_with_chunking,      the chunked head for the reference pass
ref.entropy_from_logits_chunk_size
model/critic.enable_gradient_checkpointing  Hugging Face ``gradient_checkpointing_enable(use_reentrant=False)``
                                            on the policy (actor, SFT) / the critic backbone
model/critic.enable_activation_offload      ``ForwardOptions.offload_activations`` of the training passes
                                            (``save_on_cpu``, CUDA only; a warning on CPU)
model.use_liger                             liger-kernel's instance patch on the policy and its reference copy
model.lora_rank, model.lora_alpha,          checked here with the other policy switches
model.target_modules, model.lora_dropout,   (``posttrain.models.lora.check_lora_config``); applied by
model.lora_adapter_path                     ``posttrain.models.lora.apply_lora`` in the RL and SFT setup
reward.model.use_remove_padding             read by ``build_components``: ``RewardModelScorer(remove_padding=...)``
==========================================  ====================================================================
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from posttrain.config.schema import PostTrainConfig
from posttrain.models.forward import ForwardOptions, check_plain_lm_head
from posttrain.models.packed_forward import preferred_attn_implementation
from posttrain.models.registry import check_packing_supported
from posttrain.utils.console import warn_once


@dataclass(frozen=True)
class PassOptions:
    """The :class:`ForwardOptions` of every pass of a run, built once from the config."""

    actor: ForwardOptions  # actor update (forward + backward)
    old_log_prob: ForwardOptions  # forward-only, the actor's module
    ref: ForwardOptions  # forward-only, the reference copy
    critic: ForwardOptions  # critic update and the values pass
    sft: ForwardOptions  # SFT (the policy model, like the actor)


def _chunk(enabled: bool, size: int) -> int | None:
    return size if enabled else None


def pass_options(cfg: PostTrainConfig, device: torch.device) -> PassOptions:
    """Map the config's switches to each pass's forward options (see the module table)."""
    m, a, r, c = cfg.model, cfg.actor, cfg.ref, cfg.critic
    rows = m.remove_padding_max_row_tokens
    offload_policy = m.enable_activation_offload and device.type == "cuda"
    offload_critic = c.enable_activation_offload and device.type == "cuda"
    actor_chunk = _chunk(a.entropy_from_logits_with_chunking, a.entropy_from_logits_chunk_size)
    grouped = a.use_prefix_grouper
    return PassOptions(
        actor=ForwardOptions(
            remove_padding=m.use_remove_padding, max_row_tokens=rows, logprob_chunk_size=actor_chunk,
            chunk_checkpoint=a.entropy_checkpointing, offload_activations=offload_policy, prefix_grouper=grouped,
        ),
        old_log_prob=ForwardOptions(
            remove_padding=m.use_remove_padding, max_row_tokens=rows, logprob_chunk_size=actor_chunk,
            prefix_grouper=grouped,
        ),
        ref=ForwardOptions(
            remove_padding=m.use_remove_padding, max_row_tokens=rows,
            logprob_chunk_size=_chunk(r.entropy_from_logits_with_chunking, r.entropy_from_logits_chunk_size),
            prefix_grouper=grouped,
        ),
        critic=ForwardOptions(
            remove_padding=c.use_remove_padding, max_row_tokens=rows, offload_activations=offload_critic
        ),
        sft=ForwardOptions(
            remove_padding=m.use_remove_padding, max_row_tokens=rows, offload_activations=offload_policy
        ),
    )  # fmt: skip


def read_model_config(path: str):
    """The Hugging Face config of a model directory without loading weights (None when there is none:
    the model loader reports that). ``builtin:tiny`` is a tiny Qwen2."""
    from transformers import AutoConfig, Qwen2Config

    if path == "builtin:tiny":
        return Qwen2Config()  # posttrain.models.tiny builds a Qwen2; only model_type and the head matter here
    if not (Path(path) / "config.json").is_file():
        return None
    return AutoConfig.from_pretrained(path, local_files_only=True)


def check_packing(key: str, model_config) -> None:
    """ValueError naming ``key`` when the architecture is not verified for packed forwards."""
    try:
        check_packing_supported(model_config)
    except ValueError as err:
        raise ValueError(f"{key}=true: {err}") from None


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
        missing.append(f"a CUDA device (the run is on {device.type}; Liger's Triton kernels cannot run on CPU)")
    if importlib.util.find_spec("liger_kernel") is None:
        missing.append("the liger-kernel package (pip install liger-kernel)")
    if missing:
        raise ValueError(f"model.use_liger=true needs {' and '.join(missing)}; set model.use_liger=false")
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = getattr(model_config, "model_type", None)
    if model_config is not None and model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ValueError(
            f"model.use_liger=true: liger-kernel has no kernels for model_type={model_type!r} (supported: "
            f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); set model.use_liger=false"
        )


def check_policy_switches(cfg: PostTrainConfig, device: torch.device, model_config) -> None:
    """The policy model's switches (RL and SFT): packing support, liger, activation offload, LoRA."""
    from posttrain.models.lora import check_lora_config

    check_lora_config(cfg, model_config)
    if cfg.model.use_remove_padding and model_config is not None:
        check_packing("model.use_remove_padding", model_config)
    if cfg.model.use_liger:
        check_liger(device, model_config)
    if cfg.model.enable_activation_offload:
        warn_offload_on_cpu("model.enable_activation_offload", device)


def check_rl_switches(cfg: PostTrainConfig, device: torch.device, uses_ref: bool, uses_critic: bool) -> None:
    """Validate every switch of an RL run from configs alone, before data or weights load.

    Raises ValueError naming the key, its value, the rule and the fix.
    """
    a = cfg.actor
    if a.entropy_checkpointing and not a.entropy_from_logits_with_chunking:
        raise ValueError(
            "actor.entropy_checkpointing=true recomputes the chunked log-prob head's logits in backward, so it "
            "needs actor.entropy_from_logits_with_chunking=true; set both, or drop actor.entropy_checkpointing"
        )
    policy_config = read_model_config(cfg.model.path)
    check_policy_switches(cfg, device, policy_config)
    if a.use_prefix_grouper:
        check_prefix_grouper(cfg, policy_config)
    if policy_config is not None:
        if a.entropy_from_logits_with_chunking:
            check_plain_lm_head(policy_config, "actor.entropy_from_logits_with_chunking")
        if uses_ref and cfg.ref.entropy_from_logits_with_chunking:
            check_plain_lm_head(policy_config, "ref.entropy_from_logits_with_chunking")
    if uses_critic:
        critic_config = read_model_config(cfg.critic.model_path or cfg.model.path)
        if cfg.critic.use_remove_padding and critic_config is not None:
            check_packing("critic.use_remove_padding", critic_config)
        if cfg.critic.enable_activation_offload:
            warn_offload_on_cpu("critic.enable_activation_offload", device)


def check_prefix_grouper(cfg: PostTrainConfig, model_config) -> None:
    """ValueError naming ``actor.use_prefix_grouper`` when Ulysses SP is on or the model's attention has a
    sliding window (the shared-prompt mask is a plain causal one)."""
    sp = {"actor": cfg.actor.ulysses_sequence_parallel_size, "ref": cfg.ref.ulysses_sequence_parallel_size}
    for role, size in sp.items():
        if size > 1:
            raise ValueError(
                f"actor.use_prefix_grouper=true cannot be combined with {role}.ulysses_sequence_parallel_size="
                f"{size} (the shared-prompt mask is not split across ranks); set one of them back "
                f"(use_prefix_grouper=false, or ulysses_sequence_parallel_size=1)"
            )
    if model_config is None:
        return
    layer_types = getattr(model_config, "layer_types", None) or ()
    windowed = "sliding_attention" in layer_types or (
        getattr(model_config, "use_sliding_window", False) and getattr(model_config, "sliding_window", None)
    )
    if windowed:
        raise ValueError(
            f"actor.use_prefix_grouper=true: model_type={model_config.model_type!r} uses sliding-window "
            "attention, which the shared-prompt mask does not reproduce; set actor.use_prefix_grouper=false"
        )


def attn_implementation(use_remove_padding: bool, device: torch.device, prefix_grouper: bool = False) -> str:
    """flash-attention 2 for packed passes on CUDA when ``flash_attn`` is installed (one row per micro-batch,
    varlen kernel), otherwise sdpa (padded batches, packed rows with a block-diagonal mask, and the prefix
    grouper's 4-D mask, which flash-attention cannot take)."""
    return preferred_attn_implementation(device) if use_remove_padding and not prefix_grouper else "sdpa"


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

    from posttrain.models.lora import hf_model

    # Liger finds the decoder through Hugging Face attribute paths, which a PEFT wrapper resolves differently.
    _apply_liger_kernel_to_instance(model=hf_model(module), fused_linear_cross_entropy=False, cross_entropy=False)


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
