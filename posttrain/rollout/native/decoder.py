"""Forward pass of a Llama/Qwen2-family decoder over a preallocated slot KV cache, for continuous batching.

The rollout engine runs the Hugging Face model's own submodules (embedding, norms, q/k/v/o projections, rotary
embedding, MLP, LM head), so weights are shared with the trainer and LoRA-wrapped projections keep working; only
the attention bookkeeping is its own. Hugging Face's forward assumes one rectangular batch; a continuous-batching
step instead mixes one decode token for each running sample with prefill chunks of new prompts, every token at its
own position in its own cache slot. Here all tokens of a step are flattened into one ``[N, hidden]`` batch for the
projections and the MLP (no padding there), and only attention is grouped:

- decode tokens (one per running sample) attend, in one batched call, to their slot's cached keys;
- prefill chunks (a prompt's tokens ``[start, start + length)``) attend, padded to the longest chunk, to their
  slot's keys ``[0, start + length)`` with a causal mask.

Grouped-query attention needs no key repetition: a KV head's query heads are laid out as extra query rows.
Architectures are accepted by name (:data:`SUPPORTED_MODEL_TYPES`) and by structure; anything else (another
attention layout, embedding scaling) goes to the engine's Hugging Face fallback, as do calls whose context
exceeds a sliding-window model's window.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

# Families whose decoder layer is: x + o_proj(attn(rope(q/k/v_proj(norm(x))))) then x + mlp(norm(x)), with
# unscaled embeddings and a final norm. Qwen3 adds a per-head RMSNorm on q and k before the rotary embedding.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class DecoderParts:
    """The submodules and shapes of a supported decoder (views of the model, nothing copied)."""

    embed: nn.Module
    layers: list[nn.Module]
    norm: nn.Module
    rotary: nn.Module
    lm_head: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    # Sliding-window models: attention equals full attention while the context fits the window; longer calls
    # go to the model's own forward.
    max_context: int | None = None


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The Hugging Face causal LM inside ``model`` (a PEFT wrapper's base model, or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_parts(model: nn.Module) -> DecoderParts | str:
    """The parts the slot forward needs, or a sentence saying why this model is not supported."""
    lm = unwrap_causal_lm(model)
    config = getattr(lm, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    layer_types = set(getattr(config, "layer_types", None) or [])
    if layer_types - {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(layer_types)} are not supported"
    body = getattr(lm, "model", None)
    names = ("embed_tokens", "layers", "norm", "rotary_emb")
    if body is None or not all(hasattr(body, n) for n in names) or not hasattr(lm, "lm_head"):
        return f"expected .model.{{{', '.join(names)}}} and .lm_head"
    for layer in body.layers:
        attn = getattr(layer, "self_attn", None)
        needed = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")
        if attn is None or not all(hasattr(attn, n) for n in needed):
            return f"decoder layers need self_attn.{{{', '.join(needed)}}}"
        if not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return "decoder layers need input_layernorm, post_attention_layernorm and mlp"
        if attn.scaling != attn.head_dim**-0.5:
            return "attention scaling other than 1/sqrt(head_dim)"
    weight = body.embed_tokens.weight
    return DecoderParts(
        embed=body.embed_tokens,
        layers=list(body.layers),
        norm=body.norm,
        rotary=body.rotary_emb,
        lm_head=lm.lm_head,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=body.layers[0].self_attn.head_dim,
        vocab_size=lm.lm_head.weight.shape[0],
        dtype=weight.dtype,
        device=weight.device,
        max_context=getattr(config, "sliding_window", None),
    )


class SlotKVCache:
    """Keys and values of ``slots`` sequences, one tensor per layer: [slots, kv_heads, length + 1, head_dim].

    Allocated once and reused across ``generate`` calls; it grows (reallocates) only when a call needs more slots
    or a longer context, and :meth:`release` frees it. The extra last position is a scratch column: fixed-shape
    decode steps (compiled / CUDA graphs) write the keys of idle slots there, where no query ever reads. One
    tensor per layer (not one stacked tensor) because ``torch.compile`` turns an in-place write into a view of a
    graph input into a copy of the whole input (measured: 90 ms per step for a 26 MB cache on CPU); a write into
    the input itself stays in place.
    """

    def __init__(self) -> None:
        self.k: list[torch.Tensor] | None = None
        self.v: list[torch.Tensor] | None = None
        self.generation = 0  # bumped on every (re)allocation: captured graphs must be rebuilt

    @property
    def slots(self) -> int:
        return 0 if self.k is None else self.k[0].shape[0]

    @property
    def length(self) -> int:
        """Usable positions per slot (the scratch column excluded)."""
        return 0 if self.k is None else self.k[0].shape[2] - 1

    def ensure(self, parts: DecoderParts, slots: int, length: int) -> None:
        """Make room for ``slots`` sequences of ``length`` positions (no-op when the buffers are big enough)."""
        fits = self.k is not None and self.slots >= slots and self.length >= length
        if fits and self.k[0].dtype == parts.dtype:
            return
        slots, length = max(slots, self.slots), max(length, self.length)
        self.release()
        shape = (slots, parts.num_kv_heads, length + 1, parts.head_dim)
        self.k = [torch.zeros(shape, dtype=parts.dtype, device=parts.device) for _ in parts.layers]
        self.v = [torch.zeros(shape, dtype=parts.dtype, device=parts.device) for _ in parts.layers]
        self.generation += 1

    def copy_prefix(self, src: int, dst: list[int], length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions (all layers) into slots ``dst``: a shared prompt."""
        index = torch.tensor(dst, dtype=torch.long, device=self.k[0].device)
        for buf in (*self.k, *self.v):
            buf[index, :, :length] = buf[src : src + 1, :, :length]

    def release(self) -> None:
        self.k = self.v = None


@dataclass
class StepInputs:
    """One forward's tokens, flattened: the ``D`` decode tokens first (ascending slots), then prefill chunks.

    input_ids, positions, slots: [N] int64 (token id, position in its sequence, cache slot).
    decode_slots: [D] int64 slots of the decode tokens, or None when they are exactly 0..D-1 (no scatter needed).
    decode_span: number of leading slots the decode attention covers (max decode slot + 1).
    decode_mask: [span, 1, 1, decode_len] bool, key position <= the slot's query position (idle slots: key 0).
    prefill_slots: [P] int64 slot of each prefill chunk; prefill_index: [N - D] int64 row of each prefill token in
        the padded [P * chunk_len] layout; prefill_mask: [P, 1, G * chunk_len, prefill_len] bool causal mask,
        repeated for the G query heads of each KV head.
    logit_rows: [R] int64 rows of the tokens whose next-token logits are needed, or None for all of them.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    num_decode: int
    decode_slots: torch.Tensor | None = None
    decode_span: int = 0
    decode_len: int = 0
    decode_mask: torch.Tensor | None = None
    prefill_slots: torch.Tensor | None = None
    prefill_index: torch.Tensor | None = None
    prefill_chunk_len: int = 0
    prefill_len: int = 0
    prefill_mask: torch.Tensor | None = None
    logit_rows: torch.Tensor | None = None


def build_step_inputs(
    parts: DecoderParts,
    decode: list[tuple[int, int, int]],
    prefill: list[tuple[int, int, list[int]]],
    logit_rows: list[int] | None,
    device: torch.device,
) -> StepInputs:
    """Assemble a step from ``decode`` = [(slot, position, token)] sorted by slot and ``prefill`` =
    [(slot, start, tokens)]; ``logit_rows`` index the flattened tokens (decode first), None = every token."""
    ids: list[int] = [t for _, _, t in decode]
    pos: list[int] = [p for _, p, _ in decode]
    slots: list[int] = [s for s, _, _ in decode]
    inputs = StepInputs(
        input_ids=torch.empty(0), positions=torch.empty(0), slots=torch.empty(0), num_decode=len(decode)
    )
    if decode:
        span = slots[-1] + 1
        query_pos = [0] * span
        for s, p in zip(slots, pos):
            query_pos[s] = p
        inputs.decode_span = span
        inputs.decode_len = max(pos) + 1
        if span != len(decode):
            inputs.decode_slots = torch.tensor(slots, dtype=torch.long, device=device)
        query = torch.tensor(query_pos, dtype=torch.long, device=device)
        keys = torch.arange(inputs.decode_len, device=device)
        inputs.decode_mask = (keys[None, :] <= query[:, None])[:, None, None, :]
    if prefill:
        chunk_len = max(len(toks) for _, _, toks in prefill)
        index: list[int] = []
        last_query: list[list[int]] = []
        for i, (slot, start, toks) in enumerate(prefill):
            ids += toks
            pos += range(start, start + len(toks))
            slots += [slot] * len(toks)
            index += range(i * chunk_len, i * chunk_len + len(toks))
            # Padded query rows repeat the chunk's last row, so that no row is fully masked (softmax of nothing).
            last_query.append([start + min(t, len(toks) - 1) for t in range(chunk_len)])
        inputs.prefill_chunk_len = chunk_len
        inputs.prefill_len = max(start + len(toks) for _, start, toks in prefill)
        inputs.prefill_slots = torch.tensor([s for s, _, _ in prefill], dtype=torch.long, device=device)
        inputs.prefill_index = torch.tensor(index, dtype=torch.long, device=device)
        query = torch.tensor(last_query, dtype=torch.long, device=device)  # [P, chunk_len]
        keys = torch.arange(inputs.prefill_len, device=device)
        mask = keys[None, None, :] <= query[:, :, None]  # [P, chunk_len, prefill_len]
        group = parts.num_heads // parts.num_kv_heads
        inputs.prefill_mask = mask[:, None].repeat(
            1, 1, group, 1
        )  # rows ordered (query head in group, token)
    inputs.input_ids = torch.tensor(ids, dtype=torch.long, device=device)
    inputs.positions = torch.tensor(pos, dtype=torch.long, device=device)
    inputs.slots = torch.tensor(slots, dtype=torch.long, device=device)
    if logit_rows is not None:
        inputs.logit_rows = torch.tensor(logit_rows, dtype=torch.long, device=device)
    return inputs


def attention_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The sdpa backends of the engine's steps: on CUDA all but cuDNN's, elsewhere torch's choice.

    Why: cuDNN's attention builds an execution plan for every new shape, and the key length of a decode step
    changes at every step. On an H100 (torch 2.11, bf16, where sdpa prefers cuDNN) a 64-sample, 128-token rollout
    of the tiny Qwen2 took 10.5, 7.2 and 4.5 s on its first three calls while plans were built; fp32, which
    uses the memory-efficient kernel, took 0.5-0.6 s.
    """
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as Hugging Face applies it (rotate_half convention). x: [N, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def forward_step(
    parts: DecoderParts, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], inputs: StepInputs
) -> torch.Tensor:
    """Run one step; write every token's keys/values into its slot; return logits [R, V] of ``logit_rows``.

    k_cache, v_cache: the :class:`SlotKVCache` buffers, per layer [slots, kv_heads, length + 1, head_dim].
    """
    n_heads, n_kv, head_dim = parts.num_heads, parts.num_kv_heads, parts.head_dim
    group = n_heads // n_kv
    num_tokens, num_decode = inputs.input_ids.shape[0], inputs.num_decode
    x = parts.embed(inputs.input_ids)
    cos, sin = parts.rotary(x, inputs.positions[None])
    cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [N, 1, head_dim], broadcast over heads
    for index, layer in enumerate(parts.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(num_tokens, n_heads, head_dim)
        k = attn.k_proj(h).view(num_tokens, n_kv, head_dim)
        v = attn.v_proj(h).view(num_tokens, n_kv, head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        # One rotation for the queries and keys together: the same element-wise products, half the kernel calls.
        qk = _rotate(torch.cat((q, k), dim=1), cos, sin)
        q, k = qk[:, :n_heads], qk[:, n_heads:]
        k_layer, v_layer = k_cache[index], v_cache[index]
        k_layer[inputs.slots, :, inputs.positions] = k
        v_layer[inputs.slots, :, inputs.positions] = v
        outs = []
        if num_decode:
            outs.append(_decode_attention(q[:num_decode], k_layer, v_layer, inputs, attn.scaling, group))
        if num_tokens > num_decode:
            outs.append(_prefill_attention(q[num_decode:], k_layer, v_layer, inputs, attn.scaling, group))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        x = x + attn.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    if inputs.logit_rows is not None:
        x = x.index_select(0, inputs.logit_rows)
    return parts.lm_head(parts.norm(x))


def _decode_attention(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    inputs: StepInputs,
    scale: float,
    group: int,
) -> torch.Tensor:
    """[D, heads * head_dim] attention output of one query per decode slot over its cached keys."""
    num, n_heads, head_dim = q.shape
    span, length = inputs.decode_span, inputs.decode_len
    q = q.view(num, n_heads // group, group, head_dim)  # a KV head's query heads become its query rows
    if inputs.decode_slots is not None:
        # Attend over the contiguous slot range (idle slots get zero queries) instead of gathering the running
        # slots' keys: copying the few queries is far cheaper than copying every key and value.
        full = q.new_zeros(span, n_heads // group, group, head_dim)
        full[inputs.decode_slots] = q
        q = full
    out = F.scaled_dot_product_attention(
        q, k_layer[:span, :, :length], v_layer[:span, :, :length], attn_mask=inputs.decode_mask, scale=scale
    )
    if inputs.decode_slots is not None:
        out = out[inputs.decode_slots]
    return out.reshape(num, n_heads * head_dim)


def _prefill_attention(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    inputs: StepInputs,
    scale: float,
    group: int,
) -> torch.Tensor:
    """[Np, heads * head_dim] causal attention of prefill chunks over their slots' keys [0, start + length)."""
    num, n_heads, head_dim = q.shape
    n_kv, chunks, chunk_len = n_heads // group, inputs.prefill_slots.shape[0], inputs.prefill_chunk_len
    padded = q.new_zeros(chunks * chunk_len, n_heads, head_dim)
    padded[inputs.prefill_index] = q
    padded = padded.view(chunks, chunk_len, n_kv, group, head_dim).permute(0, 2, 3, 1, 4)
    padded = padded.reshape(chunks, n_kv, group * chunk_len, head_dim)
    keys = k_layer.index_select(0, inputs.prefill_slots)[:, :, : inputs.prefill_len]
    values = v_layer.index_select(0, inputs.prefill_slots)[:, :, : inputs.prefill_len]
    out = F.scaled_dot_product_attention(padded, keys, values, attn_mask=inputs.prefill_mask, scale=scale)
    out = out.view(chunks, n_kv, group, chunk_len, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(chunks * chunk_len, n_heads * head_dim).index_select(0, inputs.prefill_index)
