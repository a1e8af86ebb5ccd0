"""Token log-probs and entropy from hidden states without materialising ``[N, V]`` logits.

With a 152k vocabulary, fp32 logits for 4096 tokens take 2.5 GB, and the naive path keeps several tensors
of that size alive for backward (logits, log-softmax output, softmax for the entropy, their gradients). The
chunked path multiplies ``chunk_size`` hidden rows at a time by the output projection and reduces each chunk
to two numbers per token (log-prob of the label and entropy). With ``checkpoint=True`` nothing of size
``[chunk, V]`` is kept for backward: backward recomputes each chunk's logits (one extra
``[chunk, H] x [H, V]`` matmul per chunk), so peak extra memory is a few ``[chunk_size, V]`` tensors plus
the projection's gradient, independent of ``N``.

Two recompute implementations (same values and gradients, tested against the naive path):

* ``fused=True`` (default): one autograd function over all chunks with the analytic gradient
  ``dz = g_logp * (onehot(label) - p) - g_ent * p * (log p + entropy)``; the projection gradient is
  accumulated in place into a single ``[V, H]`` buffer.
* ``fused=False``: :func:`torch.utils.checkpoint.checkpoint` around each chunk. Simpler, but autograd sums
  the chunks' ``[V, H]`` weight-gradient contributions in a buffer of its own, so it holds two
  ``[V, H]`` tensors (a 0.5 GB extra for Qwen2-0.5B's head) on top of the chunk tensors.

Per token (``z`` = logits / temperature, computed in fp32, or fp64 for fp64 inputs):
``logprob = z[label] - logsumexp(z)`` and ``entropy = logsumexp(z) - sum(softmax(z) * z)``.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint as _checkpoint

from posttrain.config.errors import ConfigError

__all__ = ["chunked_logprobs_entropy", "naive_logprobs_entropy"]


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    # fp32 at least (bf16 logits lose the precision log-prob ratios need); fp64 stays fp64 (tests).
    return (
        torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32
    )


def _check(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None
) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            f"expected hidden [N, H], lm_head_weight [V, H], labels [N]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != labels.shape[0]:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, lm_head_weight {tuple(weight.shape)}, "
            f"labels {tuple(labels.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ConfigError(f"lm_head bias must be [V={weight.shape[0]}], got {tuple(bias.shape)}")


def _chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float,
    compute_entropy: bool,
    ignore_index: int,
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Log-probs ``[C]`` (and entropy ``[C]``) of one chunk; ``weight``/``bias`` already in compute dtype.
    ``lse_out`` receives the log-partition values (used by the fused path's backward)."""
    logits = hidden.to(weight.dtype) @ weight.t()
    if bias is not None:
        logits = logits + bias
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    if lse_out is not None:
        lse_out.copy_(lse)
    ignored = labels == ignore_index
    safe = torch.where(ignored, torch.zeros_like(labels), labels)
    # gather + logsumexp avoids a second [C, V] tensor for the full log-softmax.
    logprobs = logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1) - lse
    logprobs = torch.where(ignored, torch.zeros_like(logprobs), logprobs)
    if not compute_entropy:
        return (logprobs,)
    probs = torch.softmax(logits, dim=-1)
    # Without autograd recording, multiply in place: one [C, V] temporary fewer.
    weighted = probs.mul_(logits) if not torch.is_grad_enabled() else probs * logits
    return logprobs, lse - weighted.sum(-1)


class _FusedChunkedHead(torch.autograd.Function):
    """All chunks in one autograd node: forward keeps only per-token statistics, backward recomputes logits."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, labels, chunk_size, temperature, compute_entropy, ignore_index, dtype
    ):
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=dtype, device=hidden.device)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.empty(n, dtype=dtype, device=hidden.device) if compute_entropy else None
        for start in range(0, n, chunk_size):
            sl = slice(start, start + chunk_size)
            out = _chunk(
                hidden[sl], w, b, labels[sl], temperature, compute_entropy, ignore_index, lse_out=lse[sl]
            )
            logprobs[sl] = out[0]
            if compute_entropy:
                entropy[sl] = out[1]
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.settings = (chunk_size, temperature, compute_entropy, ignore_index, dtype)
        return (logprobs, entropy) if compute_entropy else (logprobs,)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy=None):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        chunk_size, temperature, compute_entropy, ignore_index, dtype = ctx.settings
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(w) if need_w else None
        grad_b = torch.zeros_like(b) if need_b else None
        g_lp_all = grad_logprobs if grad_logprobs is not None else torch.zeros_like(lse)
        g_ent_all = grad_entropy if (compute_entropy and grad_entropy is not None) else None
        for start in range(0, hidden.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            h = hidden[sl].to(dtype)
            ignored = labels[sl] == ignore_index
            g_lp = torch.where(ignored, torch.zeros_like(lse[sl]), g_lp_all[sl].to(dtype))
            logits = h @ w.t()
            if b is not None:
                logits += b
            if temperature != 1.0:
                logits /= temperature
            log_p = logits.sub_(lse[sl].unsqueeze(-1))  # in place: [C, V] log-softmax
            p = log_p.exp()
            if g_ent_all is not None:
                # d entropy / dz = -p * (log p + entropy); reuse the log_p buffer for it
                grad = (
                    log_p.add_(entropy[sl].unsqueeze(-1)).mul_(p).mul_(-g_ent_all[sl].to(dtype).unsqueeze(-1))
                )
                grad.sub_(p.mul_(g_lp.unsqueeze(-1)))
            else:
                grad = p.mul_(-g_lp.unsqueeze(-1))
            safe = torch.where(ignored, torch.zeros_like(labels[sl]), labels[sl])
            grad.scatter_add_(-1, safe.unsqueeze(-1), g_lp.unsqueeze(-1))  # d logp / dz: onehot(label) - p
            if temperature != 1.0:
                grad /= temperature
            if need_h:
                grad_h[sl] = (grad @ w).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(grad.t(), h)  # accumulate in place: one [V, H] buffer for all chunks
            if need_b:
                grad_b += grad.sum(0)
            del logits, log_p, p, grad
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def chunked_logprobs_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = 2048,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    checkpoint: bool = True,
    fused: bool = True,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` and entropy of the predictive distribution, ``chunk_size`` tokens at a time.

    Args:
        hidden: ``[N, H]`` final hidden states (after the last norm), any float dtype.
        lm_head_weight: ``[V, H]`` output projection; pass the embedding matrix for tied embeddings (its
            gradient then accumulates from both uses).
        labels: ``[N]`` long target ids; ``ignore_index`` entries get log-prob 0.
        bias: optional ``[V]`` output-projection bias.
        chunk_size: tokens per chunk; peak memory ~ a few ``[chunk_size, V]`` fp32 tensors.
        temperature: logits are divided by it (the sampling temperature of the rollout).
        compute_entropy: also return the entropy (differentiable, for an entropy bonus).
        checkpoint: recompute each chunk's logits in backward (no ``[N, V]`` saved for autograd). Only
            applies when gradients are being recorded; without grad, chunks are freed as they go anyway.
            ``False`` keeps every chunk's autograd graph (as much memory as the naive path).
        fused: with ``checkpoint``, use the fused autograd function (default, lowest memory) rather than
            :func:`torch.utils.checkpoint.checkpoint` per chunk. Fused does not support double backward.
        ignore_index: label value to skip.

    Returns:
        ``(logprobs [N], entropy [N] or None)`` in fp32 (fp64 if an input is fp64). Gradients w.r.t.
        ``hidden``, ``lm_head_weight`` and ``bias`` equal those of :func:`naive_logprobs_entropy`.
    """
    _check(hidden, lm_head_weight, labels, bias)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = _compute_dtype(hidden, lm_head_weight, bias)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, lm_head_weight, bias)
    )
    args = (
        hidden,
        lm_head_weight,
        bias,
        labels,
        chunk_size,
        float(temperature),
        compute_entropy,
        ignore_index,
        dtype,
    )
    if checkpoint and fused and needs_grad and hidden.shape[0] > 0:
        out = _FusedChunkedHead.apply(*args)
        return out[0], (out[1] if compute_entropy else None)
    return _chunk_by_chunk(*args, recompute=checkpoint and needs_grad)


def _chunk_by_chunk(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    chunk_size: int,
    temperature: float,
    compute_entropy: bool,
    ignore_index: int,
    dtype: torch.dtype,
    *,
    recompute: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unfused path: :func:`_chunk` on each chunk, under :func:`torch.utils.checkpoint.checkpoint` when
    ``recompute`` (else each chunk keeps its autograd graph, or none without grad)."""
    # Cast once: casting inside each chunk would store one [V, H] copy per chunk for backward.
    weight = lm_head_weight.to(dtype)
    b = bias.to(dtype) if bias is not None else None
    logprob_chunks: list[torch.Tensor] = []
    entropy_chunks: list[torch.Tensor] = []
    for start in range(0, hidden.shape[0], chunk_size):
        args = (
            hidden[start : start + chunk_size],
            weight,
            b,
            labels[start : start + chunk_size],
            temperature,
            compute_entropy,
            ignore_index,
        )
        if recompute:
            out = _checkpoint(_chunk, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            out = _chunk(*args)
        logprob_chunks.append(out[0])
        if compute_entropy:
            entropy_chunks.append(out[1])
    if not logprob_chunks:
        empty = hidden.new_zeros(0, dtype=dtype)
        return empty, (empty.clone() if compute_entropy else None)
    logprobs = torch.cat(logprob_chunks)
    entropy = torch.cat(entropy_chunks) if compute_entropy else None
    return logprobs, entropy


def naive_logprobs_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference path: full ``[N, V]`` fp32 logits, full log-softmax, gather (what most trainers do).

    Same signature and results as :func:`chunked_logprobs_entropy`; kept for tests and the memory benchmark.
    """
    _check(hidden, lm_head_weight, labels, bias)
    dtype = _compute_dtype(hidden, lm_head_weight, bias)
    logits = hidden.to(dtype) @ lm_head_weight.to(dtype).t()
    if bias is not None:
        logits = logits + bias.to(dtype)
    logits = logits / temperature
    log_probs_all = torch.log_softmax(logits, dim=-1)
    ignored = labels == ignore_index
    safe = torch.where(ignored, torch.zeros_like(labels), labels)
    logprobs = log_probs_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    logprobs = torch.where(ignored, torch.zeros_like(logprobs), logprobs)
    entropy = -(log_probs_all.exp() * log_probs_all).sum(-1) if compute_entropy else None
    return logprobs, entropy
