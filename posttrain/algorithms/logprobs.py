"""Token log-probabilities and entropies from logits.

The math runs in at least float32 (bf16/fp16 logits are upcast; float64 stays float64), so results do not depend
on the model's compute dtype (verl's ``entropy_from_logits`` computes in the input dtype). The memory-bounded,
chunked path the trainer uses for large vocabularies is posttrain.forward.chunked_head.
"""

from __future__ import annotations

import torch


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label: ``logits[label] - logsumexp(logits)``.

    Avoids materialising a full ``[N, V]`` log-softmax (only the row-wise logsumexp is kept).

    Args:
        logits: ``[..., V]`` unnormalised scores (any float dtype).
        labels: ``[...]`` long token ids in ``[0, V)``.

    Returns:
        ``[...]`` log-probs in float32 (float64 for float64 logits).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits.shape[:-1] {tuple(logits.shape[:-1])}"
        )
    logits = logits.to(_compute_dtype(logits))
    picked = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`logprobs_from_logits` and :func:`entropy_from_logits` together, sharing one row-wise logsumexp
    (the same values bit for bit, one pass over ``[N, V]`` fewer)."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits.shape[:-1] {tuple(logits.shape[:-1])}"
        )
    logits = logits.to(_compute_dtype(logits))
    lse = torch.logsumexp(logits, dim=-1)
    picked = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    probs = torch.softmax(logits, dim=-1)
    return picked - lse, lse - (probs * logits).sum(dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution: ``logsumexp(z) - sum(softmax(z) * z)``.

    Args:
        logits: ``[..., V]``.

    Returns:
        ``[...]`` entropies in float32 (float64 for float64 logits).
    """
    logits = logits.to(_compute_dtype(logits))
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
