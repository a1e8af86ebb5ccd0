"""Prefix grouper (``actor.use_prefix_grouper``): samples that answer the same prompt run it through the model once.

GRPO-style rollouts answer every prompt ``n`` times, and a plain training forward computes each prompt's tokens
``n`` times, once per sample. Here the rows of a micro-batch whose prompts are identical become one *segment*:
the prompt's tokens once, then each of the responses, back to back::

    segment:   p0 p1 p2 p3 | a0 a1 a2 | b0 b1 | c0 c1 c2 c3
    positions:  0  1  2  3 |  4  5  6 |  4  5 |  4  5  6  7
    block:      0  0  0  0 |  1  1  1 |  2  2 |  3  3  3  3

Every response restarts its position ids at the prompt length, as if it followed the prompt alone, and a
custom attention mask lets a token see only (a) the prompt and (b) the earlier tokens of its own block. So each
response token meets exactly the keys and values it would meet in its own row, and its hidden state, log-prob
and value are those of the plain forward (up to float rounding). The prompt's hidden states are shared, so
backward sums into one copy of the prompt the gradients its ``n`` copies would have received: the parameter
gradients are the same sum.

Response token ``t`` of a sample is predicted at the last prompt position for ``t = 0`` (one position shared
by the whole group) and at its own token ``t - 1`` otherwise; :class:`PrefixGroups` records where.

Cost: a micro-batch computes ``sum over prompts (prompt + its responses)`` tokens instead of
``sum over samples (prompt + response)``; with prompts as long as responses and n = 8 that is ~1.8x fewer, and
the saving grows with the prompt's share. Attention is dense with a 4-D mask (sdpa or eager), ``L^2`` per
row, so rows are as long as the micro-batch's longest segment and shorter segments share rows (first-fit):
longer rows would only add masked-out attention cells. Flash-attention takes no such mask, so the policy is
loaded with sdpa while this switch is on.

Samples of one prompt that land in different micro-batches (or data-parallel ranks) each carry the prompt:
still exact, only less saved. Rows are grouped by their prompt *tokens*, so it needs no group ids and never
merges different prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.batching.packing import plan_rows
from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.data.batch import RolloutBatch

__all__ = ["PrefixGroups", "group_by_prompt", "prefix_attention_mask"]


@dataclass(frozen=True)
class PrefixGroups:
    """A micro-batch laid out as shared-prompt segments packed into rows.

    Attributes:
        input_ids, position_ids: ``[rows, L]`` long model inputs (row tails: pad id 0, positions counting on).
        segment_ids: ``[rows, L]`` long; equal within a segment, and unique for every pad column (a pad token
            attends to itself only).
        block_ids: ``[rows, L]`` long; 0 on a segment's prompt, ``k`` on its ``k``-th response.
        rows, cols: ``[B, R]`` long; where the hidden state predicting response token ``t`` of sample ``i`` is.
        valid: ``[B, R]`` bool; True where sample ``i`` has a response token ``t``.
        prompt_tokens_saved: prompt tokens the plain layout would have computed and this one does not.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    block_ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    valid: torch.Tensor
    prompt_tokens_saved: int


def group_by_prompt(batch: RolloutBatch) -> PrefixGroups:
    """Group the rows of ``batch`` by prompt tokens into segments and pack them (see the module docstring).

    Raises:
        ValueError: a row has response tokens but no prompt token (nothing would predict its first token).
    """
    p = batch.prompt_width
    real = batch.attention_mask.bool().cpu()
    ids = batch.input_ids.cpu()
    resp_lens = real[:, p:].sum(-1)
    members = _rows_by_prompt(ids, real, p, resp_lens)
    segments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (tokens, positions, blocks)
    first_col: dict[int, int] = {}  # sample -> column (in its segment) predicting response token 1
    segment_of: dict[int, int] = {}
    prompt_end: list[int] = []  # per segment: column of the last prompt token
    saved = 0
    for rows_of_prompt in members.values():
        head = rows_of_prompt[0]
        prompt = ids[head, :p][real[head, :p]]
        lp = int(prompt.shape[0])
        tokens, positions, blocks = [prompt], [torch.arange(lp)], [torch.zeros(lp, dtype=torch.long)]
        offset = lp
        for k, i in enumerate(rows_of_prompt, start=1):
            n = int(resp_lens[i])
            tokens.append(ids[i, p : p + n])
            positions.append(lp + torch.arange(n))
            blocks.append(torch.full((n,), k, dtype=torch.long))
            first_col[i], segment_of[i] = offset, len(segments)
            offset += n
        saved += lp * (len(rows_of_prompt) - 1)
        prompt_end.append(lp - 1)
        segments.append((torch.cat(tokens), torch.cat(positions), torch.cat(blocks)))

    input_ids, position_ids, segment_ids, block_ids, seg_row, seg_start = _pack_segments(segments)
    width = input_ids.shape[1]

    b, r_width = batch.num_rows, batch.response_width
    t = torch.arange(r_width)
    rows = torch.zeros(b, r_width, dtype=torch.long)
    cols = torch.zeros(b, r_width, dtype=torch.long)
    for i, s in segment_of.items():
        start = seg_start[s]
        rows[i] = seg_row[s]
        cols[i] = start + first_col[i] + t - 1  # token t >= 1 is predicted at response token t - 1
        cols[i, 0] = start + prompt_end[s]  # token 0 at the prompt's last token, shared by the group
    valid = t[None, :] < resp_lens[:, None]
    device = batch.input_ids.device
    return PrefixGroups(
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        segment_ids=segment_ids.to(device),
        block_ids=block_ids.to(device),
        rows=rows.to(device),
        cols=cols.clamp(0, width - 1).to(device),
        valid=valid.to(device),
        prompt_tokens_saved=saved,
    )


def _rows_by_prompt(
    ids: torch.Tensor, real: torch.Tensor, p: int, resp_lens: torch.Tensor
) -> dict[int, list[int]]:
    """The rows of each distinct prompt (rows without a prompt token, which must have no response, are left out)."""
    prompt_lens = real[:, :p].sum(-1)
    if bool(((prompt_lens == 0) & (resp_lens > 0)).any()):
        raise ConfigError("a row has response tokens but no prompt token: nothing predicts its first token")
    # Left-padded prompts of one batch share their width, so equal rows of this key mean equal prompt tokens.
    keys = ids[:, :p].masked_fill(~real[:, :p], -1)
    _, group_of = torch.unique(keys, dim=0, return_inverse=True)
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_of.tolist()):
        if int(prompt_lens[i]) > 0:
            members.setdefault(g, []).append(i)
    return members


def _pack_segments(
    segments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int]]:
    """First-fit the ``(tokens, positions, blocks)`` segments into rows as long as the longest segment.

    Returns ``input_ids, position_ids, segment_ids, block_ids`` (``[rows, L]``) and each segment's row and start
    column.
    """
    lens = [int(s[0].shape[0]) for s in segments]
    layout = plan_rows(lens, max(lens, default=1))
    width = max((sum(lens[s] for s in row) for row in layout), default=1)
    num_rows = max(len(layout), 1)
    input_ids = torch.zeros(num_rows, width, dtype=torch.long)
    position_ids = torch.arange(width).repeat(num_rows, 1)
    # Pad columns get ids past every segment's, unique per column.
    segment_ids = len(segments) + torch.arange(num_rows * width).view(num_rows, width)
    block_ids = torch.zeros(num_rows, width, dtype=torch.long)
    seg_row, seg_start = [0] * len(segments), [0] * len(segments)
    for r, row in enumerate(layout):
        col = 0
        for s in row:
            tokens, positions, blocks = segments[s]
            n = lens[s]
            input_ids[r, col : col + n] = tokens
            position_ids[r, col : col + n] = positions
            segment_ids[r, col : col + n] = s
            block_ids[r, col : col + n] = blocks
            seg_row[s], seg_start[s] = r, col
            col += n
    return input_ids, position_ids, segment_ids, block_ids, seg_row, seg_start


def prefix_attention_mask(groups: PrefixGroups, *, boolean: bool, dtype: torch.dtype) -> torch.Tensor:
    """``[rows, 1, L, L]`` mask: query ``q`` may attend key ``k`` iff both are in one segment, ``k <= q``, and
    ``k`` is in the prompt or in ``q``'s own block.

    ``boolean``: True where attention is allowed (what sdpa takes). Otherwise additive: 0 where allowed and the
    most negative ``dtype`` value elsewhere (what eager attention adds to its scores). transformers passes a
    4-D mask through unchanged.
    """
    seg, blk = groups.segment_ids, groups.block_ids
    width = seg.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=seg.device).tril()
    same_segment = seg[:, :, None] == seg[:, None, :]
    visible_block = (blk[:, None, :] == 0) | (blk[:, :, None] == blk[:, None, :])
    allowed = (same_segment & visible_block & causal)[:, None]
    if boolean:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=seg.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


def check_prefix_grouper(cfg: PostTrainConfig, model_config) -> None:
    """ValueError naming ``actor.use_prefix_grouper`` when Ulysses SP is on or the model's attention has a
    sliding window (the shared-prompt mask is a plain causal one)."""
    for role in ("actor", "ref"):
        section = getattr(cfg, role)
        if section.use_prefix_grouper and (size := section.ulysses_sequence_parallel_size) > 1:
            raise ConfigError(
                f"{role}.use_prefix_grouper=true cannot be combined with {role}.ulysses_sequence_parallel_size="
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
        raise ConfigError(
            f"actor.use_prefix_grouper=true: model_type={model_config.model_type!r} uses sliding-window "
            "attention, which the shared-prompt mask does not reproduce; set actor.use_prefix_grouper=false"
        )
