"""Attention for the prefix grouper's layout: one flat row of unique tokens, each response reading its prompt.

The prefix grouper (:mod:`posttrain.forward.prefix_grouper`) lays a micro-batch out as one row holding every
distinct prompt once and every response once, with no padding. Linear layers, norms and the MLP then run on
exactly those tokens. Attention cannot run on that row as one causal sequence; it runs here, per sequence:

- each prompt attends causally to itself (one batched call over the prompts, padded to the longest);
- each response attends to its prompt's tokens and, causally, to its own (one batched call over the responses,
  keys = ``[its prompt, padded to the longest prompt | its own tokens, padded to the longest response]``).

The query, key and value rows each call needs are gathered from the flat row by index and the outputs scattered
back, so every token meets exactly the keys it meets in its own padded row (its hidden state, log-prob and
value equal the plain forward's up to float rounding), and the attention work is that of the padded batch:
``responses x R x (P + R)``, not the square of the whole row a single causal mask would cost.

Sliding-window layers (transformers passes the window to the attention function) restrict both calls by the
positions each token has in its own row, as the plain forward's sliding mask does.

The function is registered with transformers' attention interface under :data:`SHARED_PREFIX_ATTENTION`. A model
loaded with that name behaves exactly like ``sdpa`` (the same kernel and masks) in every call that does not pass a
:class:`SharedPrefixPlan` (rollout fallbacks, SFT, the critic...); a call that passes one as the keyword argument
``shared_prefix`` runs the per-sequence attention above. The plan travels as a keyword argument, not a global,
so gradient checkpointing's recomputation in backward sees it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SHARED_PREFIX_ATTENTION = "posttrain_shared_prefix"

__all__ = [
    "SHARED_PREFIX_ATTENTION",
    "SharedPrefixPlan",
    "register_shared_prefix_attention",
    "shared_prefix_plan",
]


@dataclass(frozen=True)
class SharedPrefixPlan:
    """Where each sequence's queries and keys sit in the flat row (built once per micro-batch, used by every layer).

    prompt_tokens: ``[G, Lp]`` flat index of each prompt's tokens (tail: 0, a query whose output is never read).
    response_tokens: ``[S, Lr]`` flat index of each non-empty response's tokens (tail: 0).
    response_keys: ``[S, Lp + Lr]`` its prompt's ``prompt_tokens`` row, then its own ``response_tokens`` row.
    response_mask: ``[S, 1, Lr, Lp + Lr]`` bool; a response token sees its prompt's real tokens and its own
        tokens up to itself.
    output_index: ``[N]`` for each token of the row, its output row in the prompts' outputs ``[G * Lp]``
        followed by the responses' ``[S * Lr]``.
    response_prompt_lens: ``[S]`` the length of each response's prompt (positions, for sliding-window layers).
    """

    prompt_tokens: torch.Tensor
    response_tokens: torch.Tensor
    response_keys: torch.Tensor
    response_mask: torch.Tensor
    output_index: torch.Tensor
    response_prompt_lens: torch.Tensor


def shared_prefix_plan(
    prompt_spans: list[tuple[int, int]], response_spans: list[tuple[int, int, int]], device: torch.device
) -> SharedPrefixPlan:
    """The plan for a flat row made of ``prompt_spans`` = [(start, length)] and ``response_spans`` =
    [(start, length, index of its prompt)] (every token of the row in exactly one span; empty responses are left
    out by the caller)."""
    prompt_width = max(length for _, length in prompt_spans)
    response_width = max((length for _, length, _ in response_spans), default=1)
    num_tokens = sum(length for _, length in prompt_spans) + sum(n for _, n, _ in response_spans)
    prompt_tokens = torch.zeros(len(prompt_spans), prompt_width, dtype=torch.long)
    prompt_lens = torch.zeros(len(prompt_spans), dtype=torch.long)
    output_index = torch.empty(num_tokens, dtype=torch.long)
    for g, (start, length) in enumerate(prompt_spans):
        prompt_tokens[g, :length] = torch.arange(start, start + length)
        prompt_lens[g] = length
        output_index[start : start + length] = g * prompt_width + torch.arange(length)
    num = len(response_spans)
    response_tokens = torch.zeros(num, response_width, dtype=torch.long)
    owner = torch.zeros(num, dtype=torch.long)
    base = len(prompt_spans) * prompt_width
    for s, (start, length, g) in enumerate(response_spans):
        response_tokens[s, :length] = torch.arange(start, start + length)
        owner[s] = g
        output_index[start : start + length] = base + s * response_width + torch.arange(length)
    response_keys = torch.cat([prompt_tokens[owner], response_tokens], dim=1)
    key = torch.arange(prompt_width + response_width)
    query = torch.arange(response_width)
    own = (key[None, :] >= prompt_width) & (key[None, :] - prompt_width <= query[:, None])  # [Lr, Lp + Lr]
    in_prompt = key[None, :] < prompt_lens[owner][:, None]  # [S, Lp + Lr]
    response_mask = (own[None] | in_prompt[:, None, :])[:, None]
    return SharedPrefixPlan(
        prompt_tokens=prompt_tokens.to(device),
        response_tokens=response_tokens.to(device),
        response_keys=response_keys.to(device),
        response_mask=response_mask.to(device),
        output_index=output_index.to(device),
        response_prompt_lens=prompt_lens[owner].to(device),
    )


def _response_distance(plan: SharedPrefixPlan) -> torch.Tensor:
    """``[S, Lr, Lp + Lr]`` query position minus key position of each response (only sliding-window layers need
    it): prompt key j sits at j, own key Lp + u at lp + u, query t at lp + t."""
    prompt_width = plan.prompt_tokens.shape[1]
    device = plan.response_prompt_lens.device
    key = torch.arange(plan.response_keys.shape[1], device=device)
    query = torch.arange(plan.response_tokens.shape[1], device=device)
    lens = plan.response_prompt_lens[:, None]  # [S, 1]
    key_pos = torch.where(key[None, :] < prompt_width, key[None, :], key[None, :] - prompt_width + lens)
    return (query[None, :] + lens)[:, :, None] - key_pos[:, None, :]


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[S, heads, L, D]`` rows ``index`` ``[S, L]`` of ``x`` ``[N, heads, D]``."""
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:]).transpose(1, 2)


def _flat(out: torch.Tensor) -> torch.Tensor:
    """``[S * L, heads, D]`` from ``[S, heads, L, D]``."""
    return out.transpose(1, 2).reshape(-1, *out.shape[1:2], out.shape[-1])


def shared_prefix_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: SharedPrefixPlan,
    scaling: float | None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``[1, N, heads, D]`` attention output of the flat row (``query`` ``[1, heads, N, D]``, ``key``/``value``
    ``[1, kv_heads, N, D]``, transformers' layout) under ``plan``; with ``sliding_window`` a query sees only keys
    fewer than that many positions back (transformers' convention)."""
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, heads, D]
    gqa = q.shape[1] != k.shape[1]
    if gqa and q.is_cuda:
        # CUDA's memory-efficient kernel (the one that takes a mask) has no grouped-query mode; sdpa would fall
        # back to the math kernel. Repeating the few key/value heads keeps it (not exercised: no GPU here).
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        gqa = False
    p = plan.prompt_tokens
    prompt_mask, response_mask = None, plan.response_mask
    if sliding_window is not None and sliding_window < p.shape[1] + plan.response_tokens.shape[1]:
        pos = torch.arange(p.shape[1], device=p.device)
        distance = pos[:, None] - pos[None, :]
        prompt_mask = (distance >= 0) & (distance < sliding_window)
        response_mask = response_mask & (_response_distance(plan) < sliding_window)[:, None]
    outs = [
        F.scaled_dot_product_attention(
            _gather(q, p),
            _gather(k, p),
            _gather(v, p),
            attn_mask=prompt_mask,
            is_causal=prompt_mask is None,
            scale=scaling,
            dropout_p=dropout,
            enable_gqa=gqa,
        )
    ]
    if plan.response_tokens.shape[0]:
        keys = plan.response_keys
        outs.append(
            F.scaled_dot_product_attention(
                _gather(q, plan.response_tokens),
                _gather(k, keys),
                _gather(v, keys),
                attn_mask=response_mask,
                scale=scaling,
                dropout_p=dropout,
                enable_gqa=gqa,
            )
        )
    out = torch.cat([_flat(o) for o in outs]).index_select(0, plan.output_index)
    return out[None]


def _attention_interface(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: the shared-prefix attention when the call carries a plan
    (``shared_prefix=``), transformers' own sdpa otherwise."""
    plan = kwargs.pop("shared_prefix", None)
    if plan is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    window = kwargs.get("sliding_window")
    return shared_prefix_attention(query, key, value, plan, scaling, dropout, window), None


def register_shared_prefix_attention() -> str:
    """Register :data:`SHARED_PREFIX_ATTENTION` with transformers (idempotent) and return the name, to pass as
    ``attn_implementation=`` when loading a model whose passes use the prefix grouper. Its masks are sdpa's."""
    AttentionInterface.register(SHARED_PREFIX_ATTENTION, _attention_interface)
    AttentionMaskInterface.register(SHARED_PREFIX_ATTENTION, sdpa_mask)
    return SHARED_PREFIX_ATTENTION
