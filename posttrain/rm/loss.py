"""The Bradley-Terry loss of a reward model, and the layout of pairs on the shared update machinery.

``loss = -log sigmoid(r_chosen - r_rejected - margin)`` per pair, plus, with a centering coefficient c,
``c * (r_chosen + r_rejected)^2`` (keeps rewards near 0; TRL's center_rewards_coefficient). Both are summed
over a micro-batch's pairs and divided by the pairs of the whole mini-batch (global normalisation), so
gradient accumulation over micro-batches equals one large batch.

Layout: a mini-batch of N pairs is a :class:`RolloutBatch` of 2N rows, the chosen texts in rows 0..N-1 and
the rejected ones in rows N..2N-1, ``group_ids`` = the pair's index. Each text is laid out as a "prompt"
(all but its last token) and a one-token "response" (its last token), so ``response_mask`` counts
sequences and the train package's ``accumulate_and_step`` drives the micro-batches as for the other trainers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.algorithms.aggregation import LossNormalizer
from posttrain.batching.token_budget import plan_token_micro_batches
from posttrain.data.batch import RolloutBatch, build_rollout_batch
from posttrain.rm.data import TokenizedPair
from posttrain.rm.model import packed_sequence_scores, sequence_scores
from posttrain.train.update import LossShare


def bradley_terry(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor,
    num_pairs: float,
    center_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(this share of the loss, shares of accuracy and mean margin): sums over these pairs / ``num_pairs``.

    chosen, rejected, margin: ``[n]`` float32.
    """
    diff = chosen - rejected
    loss = -F.logsigmoid(diff - margin).sum() / num_pairs
    if center_coef:
        loss = loss + center_coef * ((chosen + rejected) ** 2).sum() / num_pairs
    return loss, {
        "accuracy": (diff > 0).float().sum().detach() / num_pairs,
        "margin": diff.sum().detach() / num_pairs,
    }


def pair_batch(pairs: list[TokenizedPair], pad_token_id: int) -> tuple[RolloutBatch, torch.Tensor]:
    """(the 2N-row batch described above, ``[N]`` margins)."""
    seqs = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
    n = len(pairs)
    batch = build_rollout_batch(
        [s[:-1] for s in seqs], [s[-1:] for s in seqs], list(range(n)) * 2, pad_token_id
    )
    return batch, torch.tensor([p.margin for p in pairs], dtype=torch.float32)


def pair_micro_rows(num_pairs: int, pairs_per_micro: int) -> list[list[int]]:
    """Rows of each micro-batch: pairs lo..hi-1, their chosen rows then their rejected rows."""
    return [
        pair_rows(num_pairs, range(lo, min(lo + pairs_per_micro, num_pairs)))
        for lo in range(0, num_pairs, pairs_per_micro)
    ]


def pair_rows(num_pairs: int, pairs: list[int]) -> list[int]:
    """The rows of ``pairs`` (indices into the mini-batch): their chosen rows, then their rejected rows."""
    return list(pairs) + [num_pairs + i for i in pairs]


def pair_token_micro_rows(pairs: list[TokenizedPair], max_tokens: int) -> list[list[int]]:
    """Micro-batches by token budget (rm.use_dynamic_bsz): whole pairs, at most ``max_tokens`` real tokens
    (chosen + rejected) each, as few micro-batches as the shared planner finds (posttrain.batching.token_budget).
    The loss is normalised by the whole mini-batch's pairs, so the cut changes memory, never the gradient."""
    sizes = [len(p.chosen_ids) + len(p.rejected_ids) for p in pairs]
    return [pair_rows(len(pairs), micro) for micro in plan_token_micro_batches(sizes, max_tokens)]


def rm_loss_fn(model: nn.Module, margins: torch.Tensor, center_coef: float, packed_row_tokens: int = 0):
    """The loss function of one mini-batch for ``accumulate_and_step`` (``margins``: that mini-batch's).
    ``packed_row_tokens`` > 0: scores from the packed forward (model.use_remove_padding), rows of that many."""

    def loss_fn(micro: RolloutBatch, normalizer: LossNormalizer):
        if packed_row_tokens:
            scores = packed_sequence_scores(model, micro.input_ids, micro.attention_mask, packed_row_tokens)
        else:
            scores = sequence_scores(model, micro.input_ids, micro.attention_mask)
        half = micro.num_rows // 2
        pair_ids = micro.group_ids[:half]
        if not torch.equal(pair_ids, micro.group_ids[half:]):
            raise AssertionError("a micro-batch must hold both sides of each of its pairs")
        num_pairs = normalizer.num_sequences / 2 / normalizer.dp_size
        margin = margins.to(scores.device)[pair_ids]
        loss, metrics = bradley_terry(scores[:half], scores[half:], margin, num_pairs, center_coef)
        return loss, {f"rm/{k}": LossShare(v) for k, v in metrics.items()}

    return loss_fn
