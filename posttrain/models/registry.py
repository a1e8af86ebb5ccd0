"""Architectures verified for packed (remove-padding) forward passes.

Packing relies on the model turning restarting ``position_ids`` into per-sequence attention (transformers
does this in its shared masking code for sdpa/eager and in its flash-attention varlen path). An
architecture that builds its own mask, uses a different rotary layout, mixes state across positions
(recurrent or convolutional layers) or adds a token-dependent bias could silently attend across sequence
boundaries, so only architectures that passed the equivalence test are accepted.

To verify a new architecture:

1. add a tiny random config for it (hidden 32-64, 2 layers, vocab ~100-300) to ``TINY_CONFIGS`` in
   ``tests/models/test_packing_equivalence.py``;
2. run ``pytest tests/models/test_packing_equivalence.py -k <model_type>``: it checks that packed logits
   and gradients equal the padded ones per sequence, for eager and sdpa attention;
3. when it passes, add the ``model_type`` to :data:`PACKING_VERIFIED` below (or call
   :func:`register_packing_support` at run time for a private model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain.config.errors import ConfigError

__all__ = [
    "PACKING_VERIFIED",
    "ArchitectureSupport",
    "check_packing_supported",
    "is_packing_supported",
    "register_packing_support",
]


@dataclass(frozen=True)
class ArchitectureSupport:
    """What was verified for one ``model_type``.

    Attributes:
        model_type: the ``config.model_type`` string.
        plain_lm_head: logits are exactly ``hidden @ lm_head.weight.T (+ bias)`` (no soft-capping or
            scaling), so log-probs can be computed from hidden states by the chunked head.
    """

    model_type: str
    plain_lm_head: bool = True


PACKING_VERIFIED: dict[str, ArchitectureSupport] = {
    name: ArchitectureSupport(name) for name in ("qwen2", "qwen3", "llama", "mistral", "gemma")
}


def _model_type(model_config: Any) -> str:
    if isinstance(model_config, str):
        return model_config
    model_type = getattr(model_config, "model_type", None)
    if not model_type:
        raise ConfigError(
            f"cannot tell the architecture of {type(model_config).__name__}: it has no model_type"
        )
    return str(model_type)


def is_packing_supported(model_config: Any) -> bool:
    """True when the config's ``model_type`` (or the given string) is in :data:`PACKING_VERIFIED`."""
    return _model_type(model_config) in PACKING_VERIFIED


def check_packing_supported(model_config: Any) -> ArchitectureSupport:
    """Return the verified entry for a config (or ``model_type`` string), or raise ValueError.

    Raises:
        ValueError: naming the ``model_type`` and explaining how to verify the architecture.
    """
    model_type = _model_type(model_config)
    entry = PACKING_VERIFIED.get(model_type)
    if entry is None:
        verified = ", ".join(sorted(PACKING_VERIFIED))
        raise ConfigError(
            f"sequence packing (remove padding) is not verified for model_type={model_type!r} "
            f"(verified: {verified}). To verify it, add a tiny config of this architecture to TINY_CONFIGS in "
            f"tests/models/test_packing_equivalence.py, run "
            f"`pytest tests/models/test_packing_equivalence.py -k {model_type}` (packed logits and gradients must "
            f"equal padded ones), then add {model_type!r} to PACKING_VERIFIED in posttrain/models/registry.py "
            f"or call register_packing_support({model_type!r}). Until then, turn packing off to use padded "
            f"micro-batches."
        )
    return entry


def register_packing_support(model_type: str, *, plain_lm_head: bool = True) -> None:
    """Mark an architecture as verified (after its equivalence test passed)."""
    if not model_type:
        raise ConfigError("model_type must be a non-empty string")
    PACKING_VERIFIED[model_type] = ArchitectureSupport(model_type, plain_lm_head=plain_lm_head)
