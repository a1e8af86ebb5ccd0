"""Forward a Hugging Face causal LM on a :class:`~posttrain.batching.packing.PackedBatch`.

The call is ``model(input_ids, position_ids, attention_mask=None, use_cache=False)``. Both keyword values
matter (measured with transformers 5.x): transformers recognises packed rows from ``position_ids`` only when
no attention mask is passed and no KV cache exists. With the default ``use_cache=True`` a cache object is
created, packing detection is skipped, every token attends to the previous sequences in its row, and the
gradients are silently wrong while the loss looks plausible.

Attention back-ends:

* ``eager`` / ``sdpa`` (CPU and GPU): transformers builds a block-diagonal causal mask per row. The mask and
  scores are dense, so keep rows bounded (``pack_sequences(..., max_row_tokens=...)``).
* ``flash_attention_2`` / ``_3`` (CUDA, ``flash-attn`` installed): transformers turns restarting position ids
  into ``cu_seqlens`` for the varlen kernel, but only for a single row. Rows are therefore flattened into
  one row ``[1, R * L]`` for the call and the output is reshaped back to ``[R, L, ...]``; each row's pad
  tail has restarting positions, so it is a segment of its own and real tokens never attend to it.
  :func:`preferred_attn_implementation` picks this back-end when it is available.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

import torch

from posttrain.batching.packing import PackedBatch
from posttrain.models.registry import check_packing_supported

__all__ = ["lm_head_parameters", "packed_causal_lm_forward", "preferred_attn_implementation"]


def preferred_attn_implementation(device: torch.device | str | None = None) -> str:
    """``"flash_attention_2"`` on CUDA when the ``flash_attn`` package is importable, else ``"sdpa"``.

    Pass the result as ``attn_implementation=`` when loading a model that will run packed batches.
    """
    dev = torch.device(device) if device is not None else None
    on_cuda = dev.type == "cuda" if dev is not None else torch.cuda.is_available()
    if on_cuda and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def _uses_flash_attention(model: torch.nn.Module) -> bool:
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    return str(impl).startswith("flash_attention")


def packed_causal_lm_forward(
    model: torch.nn.Module,
    packed: PackedBatch,
    *,
    output: Literal["logits", "hidden"] = "logits",
) -> torch.Tensor:
    """Run a causal LM on packed rows.

    Args:
        model: a transformers ``*ForCausalLM`` whose ``config.model_type`` is in the packing registry.
        packed: rows from :func:`~posttrain.batching.packing.pack_sequences`.
        output: ``"logits"``: ``[R, L, V]`` from the model's own head. ``"hidden"``: the final hidden
            states ``[R, L, H]`` (after the last norm) from ``model.get_decoder()``, for computing log-probs
            chunk by chunk without materialising ``[R, L, V]`` logits
            (see :func:`posttrain.forward.chunked_head.chunked_logprobs_entropy` and
            :func:`lm_head_parameters`).

    Returns:
        ``[R, L, V]`` logits or ``[R, L, H]`` hidden states; positions past ``packed.row_lengths`` are
        padding and must be ignored (``packed.valid_mask()``).

    Raises:
        ValueError: the architecture is not verified for packing, or ``output`` is unknown.
    """
    check_packing_supported(model.config)
    if output not in ("logits", "hidden"):
        raise ValueError(f"output must be 'logits' or 'hidden', got {output!r}")
    input_ids, position_ids = packed.input_ids, packed.position_ids
    rows, width = input_ids.shape
    flatten = _uses_flash_attention(model) and rows > 1
    if flatten:
        input_ids = input_ids.reshape(1, rows * width)
        position_ids = position_ids.reshape(1, rows * width)
    # attention_mask=None and use_cache=False are what make transformers apply per-sequence attention.
    kwargs: dict[str, Any] = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "attention_mask": None,
        "use_cache": False,
    }
    if output == "logits":
        result = model(**kwargs).logits
    else:
        result = model.get_decoder()(**kwargs).last_hidden_state
    if flatten:
        result = result.reshape(rows, width, result.shape[-1])
    return result


def lm_head_parameters(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [V, H], bias [V] or None)`` of the output projection, for the chunked head.

    With tied embeddings this is the input embedding matrix itself, so gradients reach it through either
    path. Raises ValueError for heads that are not a plain linear map (logit soft-capping or scaling).
    """
    entry = check_packing_supported(model.config)
    config = model.config
    if (
        not entry.plain_lm_head
        or getattr(config, "final_logit_softcapping", None)
        or getattr(config, "logit_scale", None)
    ):
        raise ValueError(
            f"model_type={config.model_type!r} transforms its logits after the output projection "
            f"(soft-capping or scaling); compute log-probs from the model's logits instead of hidden states"
        )
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"model_type={config.model_type!r} has no linear output embedding to read")
    return head.weight, getattr(head, "bias", None)
