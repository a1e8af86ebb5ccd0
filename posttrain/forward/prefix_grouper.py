"""Prefix grouper (``actor.use_prefix_grouper``): samples that answer the same prompt run it through the model once.

GRPO-style rollouts answer every prompt ``n`` times, and a plain training forward computes each prompt's tokens
``n`` times, once per sample. Here a micro-batch becomes one flat row of unique tokens: each distinct prompt once,
followed by the responses to it, back to back, with no padding::

    row:       p0 p1 p2 p3 a0 a1 a2 b0 b1 | q0 q1 c0 c1 c2 c3
    positions:  0  1  2  3  4  5  6  4  5 |  0  1  2  3  4  5

Every response restarts its position ids at its prompt's length, as if it followed the prompt alone, and the
attention (:mod:`posttrain.forward.shared_prefix`) lets a token see only (a) its prompt and (b) the earlier tokens
of its own response. So each response token meets exactly the keys and values it would meet in its own row, and
its hidden state, log-prob and value are those of the plain forward (up to float rounding). The prompt's hidden
states are shared, so backward sums into one copy of the prompt the gradients its ``n`` copies would have
received: the parameter gradients are the same sum.

Response token ``t`` of a sample is predicted at the last prompt position for ``t = 0`` (one position shared
by the whole group) and at its own token ``t - 1`` otherwise; :class:`PrefixGroups` records where.

Cost: the linear layers, norms and MLP compute ``sum over prompts (prompt + its responses)`` tokens instead of
``sum over samples (prompt + response)`` padded to the micro-batch's widest row: each prompt once and no padding.
Attention costs what the padded batch's does (each response against its prompt and itself). The policy is loaded
with the shared-prefix attention (sdpa in every other call).

Samples of one prompt that land in different micro-batches (or data-parallel ranks) each carry the prompt:
still exact, only less saved. Rows are grouped by their prompt *tokens*, so it needs no group ids and never
merges different prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.data.batch import RolloutBatch
from posttrain.forward.shared_prefix import SharedPrefixPlan, shared_prefix_plan

__all__ = ["PrefixGroups", "group_by_prompt"]


@dataclass(frozen=True)
class PrefixGroups:
    """A micro-batch laid out as one flat row: each distinct prompt once, followed by its responses.

    Attributes:
        input_ids, position_ids: ``[1, N]`` long model inputs (every token real: no padding).
        attention: where each prompt's and response's queries and keys sit in the row
            (:class:`~posttrain.forward.shared_prefix.SharedPrefixPlan`).
        rows, cols: ``[B, R]`` long; where the hidden state predicting response token ``t`` of sample ``i`` is.
        valid: ``[B, R]`` bool; True where sample ``i`` has a response token ``t``.
        prompt_tokens_saved: prompt tokens the plain layout would have computed and this one does not.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention: SharedPrefixPlan
    rows: torch.Tensor
    cols: torch.Tensor
    valid: torch.Tensor
    prompt_tokens_saved: int


def group_by_prompt(batch: RolloutBatch) -> PrefixGroups:
    """Group the rows of ``batch`` by prompt tokens into one flat row (see the module docstring).

    Raises:
        ConfigError: a row has response tokens but no prompt token (nothing would predict its first token).
    """
    p = batch.prompt_width
    real = batch.attention_mask.bool().cpu()
    ids = batch.input_ids.cpu()
    resp_lens = real[:, p:].sum(-1)
    members = _rows_by_prompt(ids, real, p, resp_lens)
    tokens, positions = [], []
    prompt_spans: list[tuple[int, int]] = []  # (start, length) in the row
    response_spans: list[tuple[int, int, int]] = []  # (start, length, prompt index), non-empty responses
    first_col: dict[int, int] = {}  # sample -> column predicting its response token 1
    prompt_end: dict[int, int] = {}  # sample -> column of its prompt's last token (predicts response token 0)
    offset = saved = 0
    for g, rows_of_prompt in enumerate(members.values()):
        head = rows_of_prompt[0]
        prompt = ids[head, :p][real[head, :p]]
        lp = int(prompt.shape[0])
        tokens.append(prompt)
        positions.append(torch.arange(lp))
        prompt_spans.append((offset, lp))
        offset += lp
        for i in rows_of_prompt:
            n = int(resp_lens[i])
            tokens.append(ids[i, p : p + n])
            positions.append(lp + torch.arange(n))
            first_col[i], prompt_end[i] = offset, prompt_spans[-1][0] + lp - 1
            if n:
                response_spans.append((offset, n, g))
            offset += n
        saved += lp * (len(rows_of_prompt) - 1)

    device = batch.input_ids.device
    b, r_width = batch.num_rows, batch.response_width
    t = torch.arange(r_width)
    cols = torch.zeros(b, r_width, dtype=torch.long)
    for i in first_col:
        cols[i] = first_col[i] + t - 1  # token t >= 1 is predicted at response token t - 1
        cols[i, 0] = prompt_end[i]  # token 0 at the prompt's last token, shared by the group
    valid = t[None, :] < resp_lens[:, None]
    width = max(offset, 1)
    return PrefixGroups(
        input_ids=torch.cat(tokens)[None].to(device) if tokens else torch.zeros(1, 1, dtype=torch.long),
        position_ids=torch.cat(positions)[None].to(device)
        if positions
        else torch.zeros(1, 1, dtype=torch.long),
        attention=shared_prefix_plan(prompt_spans, response_spans, device),
        rows=torch.zeros(b, r_width, dtype=torch.long, device=device),
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


def check_prefix_grouper(cfg: PostTrainConfig) -> None:
    """ConfigError naming ``{role}.use_prefix_grouper`` when it is set together with Ulysses SP (the shared-prefix
    attention works on whole sequences, not on a rank's slice of them)."""
    for role in ("actor", "ref"):
        section = getattr(cfg, role)
        if section.use_prefix_grouper and (size := section.ulysses_sequence_parallel_size) > 1:
            raise ConfigError(
                f"{role}.use_prefix_grouper=true cannot be combined with {role}.ulysses_sequence_parallel_size="
                f"{size} (the shared-prefix attention is not split across ranks); set one of them back "
                f"(use_prefix_grouper=false, or ulysses_sequence_parallel_size=1)"
            )
