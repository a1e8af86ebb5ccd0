"""GKD's generalized Jensen-Shannon divergence between the student's and the teacher's next-token
distributions (Agarwal et al., "On-Policy Distillation of Language Models", Eq. 1; TRL's ``GKDTrainer``):

    JSD_beta(T || S) = beta * KL(T || M) + (1 - beta) * KL(S || M),   M = beta * T + (1 - beta) * S

so that beta = 0 is the forward KL(T || S) and beta = 1 the reverse KL(S || T) (both taken exactly at the end
points, as TRL does). Both distributions are softmaxes of logits / temperature, over the whole vocabulary, or
(``top_k`` > 0) over the teacher's k most likely tokens with both renormalised there.

:func:`chunked_generalized_jsd` computes the masked sum from hidden states and LM-head weights a chunk of tokens
at a time, recomputing each chunk's logits in backward: neither model's ``[tokens, vocab]`` logits exist whole.
The actor's loss adds it with ``distill.gkd_coef`` (``posttrain.train.losses``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``[N]`` KL(p || q) over the last dimension from log-probabilities."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    top_k: int = 0,
) -> torch.Tensor:
    """``[N]`` the generalized JSD per token of ``[N, V]`` logits (computed in fp32). Gradient flows to
    ``student_logits`` (detach the teacher's)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta} must be in [0, 1]")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    student, teacher = student_logits.float() / temperature, teacher_logits.float() / temperature
    if top_k > 0:  # the teacher's k most likely tokens, both distributions renormalised over them
        index = teacher.topk(min(top_k, teacher.shape[-1]), dim=-1).indices
        student, teacher = student.gather(-1, index), teacher.gather(-1, index)
    log_s, log_t = F.log_softmax(student, dim=-1), F.log_softmax(teacher, dim=-1)
    if beta == 0.0:
        return _kl(log_t, log_s)
    if beta == 1.0:
        return _kl(log_s, log_t)
    log_m = torch.logaddexp(log_t + math.log(beta), log_s + math.log1p(-beta))
    return beta * _kl(log_t, log_m) + (1.0 - beta) * _kl(log_s, log_m)


def _linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(hidden, weight, bias)


def chunked_generalized_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    top_k: int = 0,
    chunk_size: int = 1024,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[N]`` :func:`generalized_jsd` of each token with ``mask`` (0 elsewhere), from final hidden states
    ``[N, H]`` / ``[N, H_t]`` and LM-head weights ``[V, H]`` / ``[V, H_t]``: ``chunk_size`` tokens at a time,
    each chunk's logits recomputed in backward. No gradient reaches the teacher's tensors."""
    keep = mask.reshape(-1).nonzero().squeeze(-1)
    n = student_hidden.shape[0]
    student_hidden, teacher_hidden = (
        student_hidden.index_select(0, keep),
        teacher_hidden.index_select(0, keep),
    )
    teacher_hidden, teacher_weight = teacher_hidden.detach(), teacher_weight.detach()
    teacher_bias = teacher_bias.detach() if teacher_bias is not None else None

    def chunk_loss(h_s: torch.Tensor, h_t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t_logits = _linear(h_t, teacher_weight, teacher_bias)
        s_logits = _linear(h_s, student_weight, student_bias)
        return generalized_jsd(s_logits, t_logits, beta=beta, temperature=temperature, top_k=top_k)

    parts = [
        checkpoint(
            chunk_loss,
            student_hidden[start : start + chunk_size],
            teacher_hidden[start : start + chunk_size],
            use_reentrant=False,
        )
        for start in range(0, keep.numel(), chunk_size)
    ]
    kept = torch.cat(parts) if parts else student_hidden.new_zeros(0, dtype=torch.float32)
    return kept.new_zeros(n).index_copy(0, keep, kept)
