"""The LM head as the forward passes use it: logits with the architecture's own transform, and the plain
linear head's parameters for the chunked heads (log-probs, GKD), refused where logits are transformed after the
projection."""

from __future__ import annotations

import torch
from torch import nn

from posttrain.config.errors import ConfigError
from posttrain.models.registry import PACKING_VERIFIED

# Logit transforms after the output projection that the chunked head cannot reproduce from hidden states.
_HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def lm_head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Apply the LM head (and any final logit soft-capping the architecture uses)."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def check_plain_lm_head(config, key: str = "actor.entropy_from_logits_with_chunking") -> None:
    """Raise ValueError (naming ``key``) unless logits are exactly ``hidden @ W.T (+ b)`` for this config.

    Soft-capped or scaled heads (Gemma 2/3, Cohere, Granite, ...) transform logits after the projection, which
    the chunked head cannot reproduce from hidden states. Works on a Hugging Face config, before any weights
    are loaded.
    """
    model_type = getattr(config, "model_type", "?")
    transforms = [name for name in _HEAD_TRANSFORMS if getattr(config, name, None) not in (None, 0, 1)]
    entry = PACKING_VERIFIED.get(model_type)
    if transforms or (entry is not None and not entry.plain_lm_head):
        what = ", ".join(transforms) or "registered with plain_lm_head=False"
        raise ConfigError(
            f"{key}=true computes log-probs from hidden states and the LM head weight, but "
            f"model_type={model_type!r} transforms its logits after the projection ({what}), so the result "
            f"would be wrong. Set {key}=false for this model"
        )


def chunked_head_parameters(
    model: nn.Module, key: str = "actor.entropy_from_logits_with_chunking"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [V, H], bias [V] or None)`` of a plain linear LM head, for the chunked log-prob head.

    With tied embeddings the weight is the input embedding matrix itself, so its gradient gets both uses.
    """
    check_plain_lm_head(model.config, key)
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ConfigError(
            f"{key}=true needs a linear output embedding; model_type={model.config.model_type!r} has none"
        )
    return head.weight, getattr(head, "bias", None)
