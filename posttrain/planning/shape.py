"""The few numbers of a decoder-only transformer that memory depends on, read from a Hugging Face config.

No weights are loaded and no model is built: a ``config.json`` (or a ``transformers`` config object) is enough,
so a 72B model can be estimated on a laptop. The parameter count assumes the Llama/Qwen2 family layout
(attention q/k/v/o, gated MLP with three matrices, RMSNorms); Qwen2's q/k/v biases are counted when the config
says so (``model_type=qwen2`` always has them). Mixture-of-experts, MLA and vision towers are not modelled.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.config.errors import ConfigError, MissingPathError
from posttrain.models.hub import cached_snapshot, looks_like_hub_id
from posttrain.models.tiny import build_tiny_tokenizer, tiny_config

GIB = 1024**3
_LAYER_MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _adapted(target_modules, known) -> list[str]:
    """The layer matrices (of ``known``) that LoRA ``target_modules`` adapt; 'all-linear' adapts them all."""
    names = set(known) if "all-linear" in target_modules else {t.rsplit(".", 1)[-1] for t in target_modules}
    return [n for n in known if n in names]


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only LM (all counts, no units beyond "elements")."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool

    @property
    def kv_dim(self) -> int:
        """Width of the K (or V) projection output: KV heads x head dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    def layer_params(self) -> int:
        """Parameters of one decoder layer: q/k/v/o projections (+ q/k/v bias), gated MLP, two RMSNorms."""
        h = self.hidden_size
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        return attn + 3 * h * self.intermediate_size + 2 * h

    def embedding_params(self) -> int:
        """Input embedding + LM head (counted once when tied) + the final RMSNorm."""
        emb = self.vocab_size * self.hidden_size
        return emb * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def num_params(self) -> int:
        """All parameters (exact for Llama/Qwen2-style models; tested against the built model)."""
        return self.num_layers * self.layer_params() + self.embedding_params()

    def lora_params(self, rank: int, target_modules: tuple[str, ...] | list[str] = ("all-linear",)) -> int:
        """LoRA adapter parameters: ``rank x (d_in + d_out)`` per adapted matrix. ``all-linear`` adapts q, k, v, o,
        gate, up and down in every layer; a list adapts the named ones (other names count 0: this shape knows only
        the Llama/Qwen2 layout). The LM head and embeddings get no adapter."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        sizes = {
            "q_proj": h + q,
            "k_proj": h + kv,
            "v_proj": h + kv,
            "o_proj": q + h,
            "gate_proj": h + i,
            "up_proj": h + i,
            "down_proj": i + h,
        }
        return rank * sum(sizes[n] for n in _adapted(target_modules, sizes)) * self.num_layers

    def lora_matrices_per_layer(self, target_modules: tuple[str, ...] | list[str] = ("all-linear",)) -> int:
        """How many of a layer's q, k, v, o, gate, up, down matrices carry an adapter."""
        return len(_adapted(target_modules, _LAYER_MATRICES))

    @classmethod
    def from_hf_config(cls, config: Any, name: str = "") -> ModelShape:
        """From a ``transformers`` config object or a config.json dict."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        missing = [
            k
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "vocab_size",
                "intermediate_size",
            )
            if get(k) is None
        ]
        if missing:
            raise ConfigError(
                f"model config {name!r} lacks {', '.join(missing)}: the memory estimator needs a decoder-only "
                "Llama/Qwen2-style config.json (hidden_size, num_hidden_layers, num_attention_heads, "
                "intermediate_size, vocab_size)"
            )
        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        model_type = get("model_type", "") or ""
        return cls(
            name=name or model_type,
            hidden_size=hidden,
            num_layers=int(get("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            intermediate_size=int(get("intermediate_size")),
            vocab_size=int(get("vocab_size")),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            qkv_bias=bool(get("attention_bias", model_type == "qwen2")) or model_type == "qwen2",
        )

    @classmethod
    def from_path(cls, path: str | Path) -> ModelShape:
        """From a model directory (its config.json) or a config.json file."""
        p = Path(path)
        file = p / "config.json" if p.is_dir() else p
        if not file.is_file():
            raise MissingPathError(
                f"no config.json at {str(path)!r}: pass a Hugging Face model directory or a config.json file "
                "(examples/model_configs/ has some)"
            )
        return cls.from_hf_config(json.loads(file.read_text()), name=p.name if p.is_dir() else p.parent.name)


def builtin_tiny_hf_config():
    """The Hugging Face config of the built-in tiny model (``model.path=builtin:tiny``)."""
    return tiny_config(build_tiny_tokenizer())


def shape_for_model_path(model_path: str) -> ModelShape | None:
    """The shape of ``model.path``: a built-in model, a directory with config.json, or a Hub id in the local
    Hugging Face cache (named by the id); None when absent."""
    if model_path in ("builtin:tiny", "builtin:base"):
        return ModelShape.from_hf_config(builtin_tiny_hf_config(), name=model_path)
    if (Path(model_path) / "config.json").is_file():
        return ModelShape.from_path(model_path)
    snapshot = cached_snapshot(model_path) if looks_like_hub_id(model_path) else None
    if snapshot is not None:
        return dataclasses.replace(ModelShape.from_path(snapshot), name=model_path)
    return None


def teacher_shape(teacher_path: str) -> ModelShape | None:
    """The shape of ``distill.teacher.path`` (a run directory: its final_model/); None when absent."""
    final = Path(teacher_path) / "final_model"
    return shape_for_model_path(str(final) if (final / "config.json").is_file() else teacher_path)
