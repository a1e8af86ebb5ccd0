"""The PPO critic: the actor's transformer backbone (no LM head) plus a scalar value head."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, PreTrainedModel

from posttrain.config.errors import ConfigError
from posttrain.models.hf import check_model_dir, resolve_dtype

VALUE_HEAD_FILE = "value_head.safetensors"


class CriticModel(nn.Module):
    """Token-level value model ``V(s_t)``: backbone hidden states -> ``nn.Linear(hidden, 1)``.

    The value head is kept in float32 whatever the backbone dtype (it is tiny and values feed the advantage
    computation directly). It is initialised to zeros, so a fresh critic predicts V = 0 everywhere: a neutral
    baseline that does not inject random noise into the first advantages. The backbone receives gradients from
    the second update on (once the head weight is non-zero); pass ``init_std > 0`` for a small random head instead.
    """

    def __init__(self, backbone: PreTrainedModel, value_head: nn.Linear | None = None, init_std: float = 0.0):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        if value_head is None:
            value_head = nn.Linear(hidden, 1, dtype=torch.float32, device=backbone.device)
            _init_value_head(value_head, init_std)
        self.value_head = value_head

    @property
    def config(self):
        """The backbone's Hugging Face config (hidden size, vocab, ...)."""
        return self.backbone.config

    @classmethod
    def from_causal_lm_path(
        cls,
        path: str | Path,
        dtype: str = "fp32",
        device: str | torch.device = "cpu",
        init_std: float = 0.0,
        attn_implementation: str = "sdpa",
    ) -> CriticModel:
        """A critic whose backbone is loaded from a causal LM directory (typically the actor's checkpoint).

        ``AutoModel`` loads only the base transformer; the LM head weights in the checkpoint are ignored.
        """
        path = check_model_dir(path)
        backbone = AutoModel.from_pretrained(
            path, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation, local_files_only=True
        ).to(device)
        return cls(backbone, init_std=init_std)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: str = "fp32",
        device: str | torch.device = "cpu",
        attn_implementation: str = "sdpa",
    ) -> CriticModel:
        """Reload a critic saved by :meth:`save_pretrained` (backbone dir + ``value_head.safetensors``)."""
        path = check_model_dir(path, need=VALUE_HEAD_FILE)
        critic = cls.from_causal_lm_path(
            path, dtype=dtype, device=device, attn_implementation=attn_implementation
        )
        state = load_file(str(path / VALUE_HEAD_FILE), device=str(critic.value_head.weight.device))
        critic.value_head.load_state_dict(state)
        return critic

    def save_pretrained(self, path: str | Path) -> Path:
        """Save the backbone with ``save_pretrained`` and the value head as ``value_head.safetensors``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(path)
        state = {k: v.detach().contiguous().cpu() for k, v in self.value_head.state_dict().items()}
        save_file(state, str(path / VALUE_HEAD_FILE))
        return path

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Values for every position.

        input_ids: [B, T] int64; attention_mask: [B, T] (1 = token, 0 = pad) or None;
        position_ids: [B, T] or None. For packed rows pass ``attention_mask=None`` and position_ids restarting
        at 0 for each sequence: the backbone then attends within each sequence only (needs ``use_cache=False``,
        which is always passed here).
        Returns values: [B, T] float32, ``values[b, t]`` = V(prefix up to and including token t).
        """
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        hidden = out.last_hidden_state  # [B, T, H]
        return self.value_head(hidden.float()).squeeze(-1)

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        """Enable activation checkpointing on the backbone (same switch as a Hugging Face model)."""
        self.backbone.gradient_checkpointing_enable(**kwargs)


def _init_value_head(head: nn.Linear, init_std: float) -> None:
    """Zero bias; weight zeros (``init_std == 0``) or N(0, init_std^2)."""
    if init_std < 0:
        raise ConfigError(f"init_std={init_std} must be >= 0 (0 gives a zero-initialised value head)")
    with torch.no_grad():
        head.bias.zero_()
        if init_std == 0:
            head.weight.zero_()
        else:
            head.weight.normal_(0.0, init_std)
