"""Loss aggregation over a mini-batch with global denominators.

A per-token loss matrix ``[B, T]`` becomes a scalar in one of four ways (verl's ``loss_agg_mode`` names):

- ``"token-mean"``: sum over all valid tokens / number of valid tokens.
- ``"seq-mean-token-sum"``: per sequence the token sum, then the mean over sequences.
- ``"seq-mean-token-mean"``: per sequence the token mean, then the mean over sequences.
- ``"seq-mean-token-sum-norm"``: per sequence the token sum, mean over sequences, divided by a fixed horizon
  (Dr.GRPO).

Every denominator (tokens, sequences, horizon) belongs to the whole *mini-batch* (one optimizer step, across all
data-parallel ranks), never to a micro-batch. :class:`LossNormalizer` carries these counts; it is computed once
per mini-batch and passed to every :func:`aggregate_loss` call. ``aggregate_loss`` then returns a micro-batch's
*contribution*, and the contributions of any split of the mini-batch into micro-batches sum to the loss of the
whole mini-batch computed in one piece. Dividing each micro-batch by its own counts (and then by the number of
micro-batches) silently reweights tokens and sequences whenever lengths differ; see verl-project/verl#5625 and
#5072 for that bug in the wild.

Deliberate differences from verl's ``agg_loss``:

- ``seq-mean-token-sum-norm`` divides by ``LossNormalizer.norm_constant`` (set it to ``max_response_length``),
  whereas verl defaults to ``loss_mask.shape[-1]``, which changes with the padded width of each batch.
- A mini-batch with no valid tokens (or no valid sequences) gives a zero loss instead of ``0 / 0 = NaN``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.algorithms.masked import MEAN_EPS, masked_sum
from posttrain.algorithms.names import LOSS_AGG_MODES


def check_loss_agg_mode(loss_agg_mode: str) -> None:
    """Raise ValueError naming ``loss_agg_mode`` and the valid modes if it is not one of :data:`LOSS_AGG_MODES`."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"loss_agg_mode={loss_agg_mode!r} is not supported; valid modes: {list(LOSS_AGG_MODES)}"
        )


@dataclass(frozen=True)
class LossNormalizer:
    """Global denominators of one mini-batch.

    Attributes:
        num_tokens: valid (masked-in) tokens in the whole mini-batch, summed over all data-parallel ranks.
        num_sequences: sequences of the mini-batch, over all ranks, that have at least one valid token. Fully
            masked rows do not count, matching verl's ``agg_loss`` when it derives the count from the mask
            (``(loss_mask.sum(-1) > 0).sum()``); such rows contribute nothing to the numerator either.
        norm_constant: the fixed horizon of ``seq-mean-token-sum-norm``; use the configured maximum response
            length so the scale does not depend on how a batch happens to be padded.
        dp_size: data-parallel world size. Each rank's contribution is multiplied by it because DDP/FSDP
            *average* gradients over ranks; leave it at 1 when gradients are summed or there is one rank.

    With several ranks, build each rank's normalizer with :meth:`from_mask`, all-reduce (sum) ``num_tokens``
    and ``num_sequences``, and construct the global one with ``dp_size`` set.
    """

    num_tokens: float
    num_sequences: float
    norm_constant: float
    dp_size: int = 1

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {self.num_tokens}")
        if self.num_sequences < 0:
            raise ValueError(f"num_sequences must be >= 0, got {self.num_sequences}")
        if not self.norm_constant > 0:
            raise ValueError(
                f"norm_constant must be > 0, got {self.norm_constant}; use the maximum response length"
            )
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")

    @classmethod
    def from_mask(cls, response_mask: torch.Tensor, norm_constant: float, dp_size: int = 1) -> LossNormalizer:
        """Counts of a whole mini-batch (on this rank).

        Args:
            response_mask: ``[B, T]`` bool or float mask of the *whole* mini-batch, not of a micro-batch.
            norm_constant: horizon for ``seq-mean-token-sum-norm`` (the maximum response length).
            dp_size: data-parallel world size (see the class docstring).
        """
        if response_mask.dim() != 2:
            raise ValueError(f"response_mask must be [B, T], got shape {tuple(response_mask.shape)}")
        mask = response_mask.to(torch.float64)
        num_tokens = float(mask.sum().item())
        num_sequences = float((mask.sum(dim=-1) > 0).sum().item())
        return cls(
            num_tokens=num_tokens,
            num_sequences=num_sequences,
            norm_constant=float(norm_constant),
            dp_size=dp_size,
        )


def _nonzero(count: float) -> float:
    """An empty mini-batch has a zero numerator; divide by 1 instead of 0 so the loss is 0, not NaN."""
    return count if count > 0 else 1.0


def aggregate_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    normalizer: LossNormalizer,
) -> torch.Tensor:
    """This micro-batch's contribution to the mini-batch loss.

    Summing the result over the micro-batches of a mini-batch (or backpropagating each one separately) gives
    exactly the loss (gradient) of the whole mini-batch; do not divide by the number of micro-batches.

    Args:
        loss_mat: ``[b, T]`` per-token loss of this micro-batch.
        loss_mask: ``[b, T]`` bool or float mask of this micro-batch.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
        normalizer: counts of the whole mini-batch, see :class:`LossNormalizer`.

    Returns:
        Scalar tensor (differentiable w.r.t. ``loss_mat``).
    """
    check_loss_agg_mode(loss_agg_mode)
    if loss_mat.shape != loss_mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mat and loss_mask must both be [B, T]; got {tuple(loss_mat.shape)} and {tuple(loss_mask.shape)}"
        )
    scale = float(normalizer.dp_size)
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) * (scale / _nonzero(normalizer.num_tokens))

    token_sums = masked_sum(loss_mat, loss_mask, dim=-1)  # [b]
    token_counts = loss_mask.to(loss_mat.dtype).sum(dim=-1)  # [b]
    valid_rows = token_counts > 0
    if loss_agg_mode == "seq-mean-token-mean":
        per_seq = token_sums / (token_counts + MEAN_EPS)
    else:
        per_seq = token_sums
    seq_total = masked_sum(per_seq, valid_rows)
    loss = seq_total * (scale / _nonzero(normalizer.num_sequences))
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / normalizer.norm_constant
    return loss
