"""The distillation teacher's forward-only pass: log-probs of the student's sampled tokens and, when asked,
whether each sampled token is among the teacher's top-k at its position (verl's OPD overlap metric)."""

from __future__ import annotations

import torch
from torch import nn

from posttrain.algorithms.logprobs import logprobs_from_logits
from posttrain.data.batch import RolloutBatch
from posttrain.forward.lm_head import lm_head_logits
from posttrain.forward.passes import ForwardOptions, response_hidden_states


@torch.no_grad()
def teacher_scores(
    model: nn.Module, batch: RolloutBatch, *, temperature: float, top_k: int, options: ForwardOptions
) -> torch.Tensor:
    """``[B, R]`` the teacher's log-probs of the response tokens at ``temperature`` (the sampler's, as for the
    reference policy); with ``top_k`` > 0, ``[B, R, 2]``: log-probs and 1.0 where the sampled token's logit
    reaches the teacher's k-th largest. Computed as :func:`posttrain.forward.passes.policy_logprobs` does
    without the chunked head, so a teacher equal to the student gives exactly the old-log-prob pass's
    numbers; pad positions (packed layout) are 0. With ``options.logprob_chunk_size`` the LM head runs that many
    tokens at a time (``distill.teacher.logprob_chunk_size``): only one chunk's ``[chunk, V]`` logits exist."""
    hidden = response_hidden_states(model, batch, options)
    b, r, h = hidden.shape
    flat_hidden, labels = hidden.reshape(b * r, h), batch.responses.reshape(-1)
    index = None
    if (
        options.remove_padding or options.prefix_grouper
    ):  # pad positions carry no token: skip them in the head
        index = batch.attention_mask[:, batch.prompt_width :].reshape(-1).nonzero().squeeze(-1)
        flat_hidden, labels = flat_hidden.index_select(0, index), labels.index_select(0, index)
    chunk = options.logprob_chunk_size or max(1, flat_hidden.shape[0])
    out = torch.cat(
        [
            _head_scores(model, flat_hidden[i : i + chunk], labels[i : i + chunk], temperature, top_k)
            for i in range(0, flat_hidden.shape[0], chunk)
        ]
        or [flat_hidden.new_zeros((0, 2 if top_k > 0 else 1), dtype=torch.float32)]
    )
    if index is not None:
        out = out.new_zeros((b * r, out.shape[-1])).index_copy(0, index, out)
    out = out.view(b, r, -1)
    return out if top_k > 0 else out[..., 0]


def _head_scores(
    model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, temperature: float, top_k: int
) -> torch.Tensor:
    """``[N, 1 or 2]`` the log-probs of ``labels`` (and top-k membership) from final hidden states ``[N, H]``."""
    logits = lm_head_logits(model, hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    columns = [logprobs_from_logits(logits, labels)]
    if top_k > 0:
        k = min(top_k, logits.shape[-1])
        kth = logits.topk(k, dim=-1).values[:, -1]
        columns.append((logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) >= kth).float())
    return torch.stack(columns, dim=-1)
