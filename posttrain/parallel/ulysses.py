"""Ulysses sequence parallelism (SP): the ranks of an SP group each hold a slice of every sequence.

A long sequence's activations no longer fit on one device; SP splits the sequence dimension over the ``sp``
ranks of a group. Everything in a decoder except attention is per token (embeddings, norms, MLP, RoPE with the
tokens' global position ids, LM head), so it runs unchanged on the local slice. Attention needs the whole
sequence, so around it two all-to-alls swap which dimension is split::

    q, k, v   [b, heads, seq/sp, d]  --all-to-all-->  [b, heads/sp, seq, d]   (this rank's heads, all tokens)
    attention on the full sequence, one head group per rank (the model's own sdpa / flash-attention)
    output    [b, seq, heads/sp, d]  --all-to-all-->  [b, seq/sp, heads, d]   (all heads, this rank's tokens)

With grouped-query attention and fewer KV heads than ranks, each KV head is replicated ``sp / kv_heads``
times before the swap, so every rank receives the KV head its query heads read.

How a forward uses it (``posttrain.forward.passes`` does this for ``ForwardOptions.sp_group``)::

    inputs = shard_inputs(body.config, input_ids, position_ids, attention_mask, group, dtype=...)
    hidden = body(**inputs.model_kwargs()).last_hidden_state        # [rows, L'/sp, H]: this rank's tokens
    per_token = ...                                                 # head on local tokens: [rows, L'/sp]
    full = gather_sequence(per_token, group)                        # [rows, L'] on every rank

Why the SP state travels as a keyword argument of the model call (``ulysses=UlyssesCall``) and not as
module-level state set by a context manager: with activation checkpointing, each decoder layer runs its
forward again during backward, after any context opened around the forward has been closed; the layer's
keyword arguments are stored with the checkpoint, so the recomputation sees the same SP group and masks.
Transformers passes unknown keyword arguments from the model call down to the attention function.

The attention wrapper is registered in transformers' ``AttentionInterface`` under the names it wraps
(``sdpa``, ``flash_attention_*``), so a model keeps its ``attn_implementation`` and every code path
transformers keys on that name (mask construction, flash-attention's varlen preparation) is unchanged. Without
the ``ulysses`` keyword the wrapper calls the original function with the original arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from transformers import AttentionInterface
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from posttrain.config.errors import ConfigError

__all__ = [
    "KWARG",
    "UlyssesCall",
    "UlyssesInputs",
    "all_to_all",
    "check_sequence_parallel_supported",
    "gather_sequence",
    "install_ulysses_attention",
    "new_sequence_parallel_group",
    "pad_to_multiple",
    "shard_inputs",
    "slice_sequence",
]

KWARG = "ulysses"
"""Name of the model-call keyword that carries a :class:`UlyssesCall` down to the attention layers."""

_WRAPPED_MARK = "_posttrain_ulysses_inner"


def _size_rank(group: ProcessGroup | None) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def new_sequence_parallel_group(sp_size: int) -> ProcessGroup | None:
    """This rank's SP group when consecutive ranks ``[d * sp, (d + 1) * sp)`` form data-parallel rank ``d``.

    Collective: every rank of the default group must call it (``dist.new_group`` is). Returns None for
    ``sp_size == 1`` (no SP). Raises ValueError when ``sp_size`` does not divide the world size.
    """
    world = dist.get_world_size()
    if sp_size < 1 or world % sp_size:
        raise ConfigError(
            f"ulysses_sequence_parallel_size={sp_size} must divide the world size ({world}); e.g. 1 or {world}"
        )
    if sp_size == 1:
        return None
    mine = None
    for start in range(0, world, sp_size):
        group = dist.new_group(list(range(start, start + sp_size)))
        if start <= dist.get_rank() < start + sp_size:
            mine = group
    return mine


# ---------------------------------------------------------------------------------------------------------
# Differentiable collectives
# ---------------------------------------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    sp = dist.get_world_size(group)
    if x.shape[scatter_dim] % sp:
        raise ConfigError(f"all_to_all: dim {scatter_dim} of {tuple(x.shape)} is not divisible by {sp} ranks")
    # Chunk i goes to rank i; chunk j of the result came from rank j (the ranks' slices in rank order).
    send = torch.stack(x.chunk(sp, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        # The gradient of a permutation of data across ranks is the inverse permutation.
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group: ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` into ``sp`` chunks along ``scatter_dim``, send chunk ``i`` to rank ``i``, and concatenate
    what the ranks sent along ``gather_dim`` (in rank order). Differentiable: backward is the reverse
    all-to-all. E.g. ``[b, h, s/sp, d]`` with ``scatter_dim=1, gather_dim=2`` becomes ``[b, h/sp, s, d]``."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        sp, rank = _size_rank(group)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(sp)]
        dist.all_gather(parts, x, group=group)
        ctx.dim, ctx.rank, ctx.local = dim, rank, x.shape[dim]
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        # Only this rank's slice, not a sum over ranks: every rank computes the same loss from the same
        # gathered tensor, and each rank's copy of the loss must reach its own tokens exactly once. The
        # parameter gradients of the group's ranks then add up to the gradient of that one loss.
        return grad.narrow(ctx.dim, ctx.rank * ctx.local, ctx.local), None, None


def gather_sequence(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Concatenate every rank's equal-sized slice along ``dim`` (rank order) on every rank.

    Backward returns this rank's slice of the incoming gradient: the loss is computed on the full gathered
    sequence, identically on every rank of the group, and the SP ranks' parameter gradients **sum** to the
    gradient of that loss. A data-parallel reduction that averages over all ``dp * sp`` ranks must therefore
    scale each rank's loss by ``dp * sp`` (not ``dp``).

    Why per-token outputs are gathered and the loss computed on full sequences (rather than a loss on local
    tokens plus an all-reduce): every loss aggregation mode (token mean, sequence mean, sequence sums...) and
    every advantage estimator then works unchanged on ``[b, R]`` tensors, while only small ``[rows, L]``
    tensors (log-probs, entropy, values) cross ranks, never ``[rows, L, H]`` hidden states or logits.
    """
    if dist.get_world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group, dim)


# ---------------------------------------------------------------------------------------------------------
# Input sharding
# ---------------------------------------------------------------------------------------------------------


def pad_to_multiple(x: torch.Tensor, multiple: int, value: float | int = 0, dim: int = 1) -> torch.Tensor:
    """``x`` padded with ``value`` at the end of ``dim`` to a length divisible by ``multiple``."""
    extra = -x.shape[dim] % multiple
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def slice_sequence(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous slice of ``dim`` (length divisible by the group size; see :func:`pad_to_multiple`)."""
    sp, rank = _size_rank(group)
    if x.shape[dim] % sp:
        raise ValueError(f"sequence length {x.shape[dim]} is not divisible by the SP size {sp}; pad it first")
    local = x.shape[dim] // sp
    return x.narrow(dim, rank * local, local)


@dataclass(eq=False)
class UlyssesCall:
    """What the attention layers of one SP forward need; passed as the model-call keyword :data:`KWARG`.

    Attributes:
        group: the SP process group.
        attention_mask: the mask transformers builds for the FULL (padded) sequence with the model's
            attention implementation: a 4D ``[rows, 1, L', L']`` mask (sdpa), a 2D padding mask (flash
            attention), or None (plain causal).
        position_ids: ``[rows, L']`` position ids of the full sequence (flash attention's varlen path derives
            the sequence boundaries of packed rows from them).
        layers_run: incremented by every attention call that took the SP path; lets the caller check that
            its attention implementation went through the wrapper.
    """

    group: ProcessGroup
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    layers_run: int = field(default=0)


@dataclass(eq=False)
class UlyssesInputs:
    """One rank's share of a micro-batch (from :func:`shard_inputs`).

    Attributes:
        input_ids, position_ids: ``[rows, L'/sp]`` this rank's tokens and their global position ids.
        model_attention_mask: what to pass as the model's ``attention_mask``: the full 4D mask when there is
            one (transformers uses a 4D mask as given, so no mask is built for the local slice), else None.
        call: the :class:`UlyssesCall` for the attention layers.
        start: first column of the full (padded) sequence that this rank holds.
        full_len: ``L'``, the sequence length padded to a multiple of ``sp``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    model_attention_mask: torch.Tensor | None
    call: UlyssesCall
    start: int
    full_len: int

    @property
    def local_len(self) -> int:
        return int(self.input_ids.shape[1])

    def model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the transformer body (``use_cache=False``: a cache changes mask handling)."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "attention_mask": self.model_attention_mask,
            "use_cache": False,
            KWARG: self.call,
        }

    def check_attention_ran(self) -> None:
        """Raise RuntimeError if no attention layer took the SP path (the forward would be silently wrong)."""
        if self.call.layers_run == 0:
            raise RuntimeError(
                "sequence parallelism was requested but no attention layer ran through the Ulysses wrapper; "
                "the model's attention implementation or its modeling code does not pass keyword arguments "
                "down to the attention function"
            )


def check_sequence_parallel_supported(config: Any, sp_size: int) -> None:
    """Raise ValueError unless a model with this Hugging Face ``config`` can run with ``sp_size`` SP ranks.

    Query heads are split over the ranks (``num_attention_heads % sp == 0``); KV heads are split too, or
    replicated when there are fewer of them than ranks (``sp % num_key_value_heads == 0``).
    """
    if sp_size == 1:
        return
    impl = str(getattr(config, "_attn_implementation", None))
    if impl != "sdpa" and not impl.startswith("flash_attention"):
        raise ConfigError(
            f"ulysses_sequence_parallel_size={sp_size} needs attn_implementation 'sdpa' or "
            f"'flash_attention_2'/'_3', the model uses {impl!r}; load it with attn_implementation='sdpa'"
        )
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % sp_size:
        raise ConfigError(
            f"ulysses_sequence_parallel_size={sp_size} must divide the model's num_attention_heads={heads}"
        )
    if kv_heads % sp_size and sp_size % kv_heads:
        raise ConfigError(
            f"ulysses_sequence_parallel_size={sp_size} must divide num_key_value_heads={kv_heads} or be a "
            f"multiple of it (then KV heads are replicated)"
        )
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        raise ConfigError(
            f"ulysses_sequence_parallel_size={sp_size}: layers with sliding-window or other non-full "
            f"attention ({sorted(set(config.layer_types))}) are not supported; set it to 1"
        )


def shard_inputs(
    config: Any,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    group: ProcessGroup,
    *,
    dtype: torch.dtype = torch.float32,
    pad_token_id: int = 0,
) -> UlyssesInputs:
    """Pad a micro-batch to a length divisible by the SP size, build its full-sequence attention mask, and
    keep this rank's slice.

    Args:
        config: the model's Hugging Face config (attention implementation, heads).
        input_ids, position_ids: ``[rows, L]`` the whole micro-batch, identical on every rank of the group.
            Padded rows with their 2D ``attention_mask``, or packed rows (``attention_mask=None``, position ids
            restarting at 0 for each sequence).
        attention_mask: ``[rows, L]`` 1 on real tokens, or None.
        group: the SP group.
        dtype: the dtype attention computes in (the additive masks of some implementations use it).
        pad_token_id: id of the appended columns.

    The appended columns come after every real token of their row, so causal attention never lets a real
    token see them (masked out in padded rows; a segment of their own, positions ``0, 1, ...``, in packed
    rows). Every rank builds the mask of the full sequence (cheap next to the forward): attention runs on the
    full sequence, so it needs the full mask, and packed-row boundaries can only be read from the full
    position ids.
    """
    sp, _ = _size_rank(group)
    check_sequence_parallel_supported(config, sp)
    install_ulysses_attention()
    input_ids, position_ids, attention_mask = _pad_for_sp(
        input_ids, position_ids, attention_mask, sp, pad_token_id
    )
    rows, full_len = input_ids.shape
    # create_causal_mask reads only the batch size, length, dtype and device of inputs_embeds.
    shape_only = torch.empty((rows, full_len, 0), dtype=dtype, device=input_ids.device)
    mask = create_causal_mask(
        config=config,
        inputs_embeds=shape_only,
        attention_mask=attention_mask,
        past_key_values=None,
        position_ids=position_ids,
    )
    local = full_len // sp
    start = dist.get_rank(group) * local
    call = UlyssesCall(group=group, attention_mask=mask, position_ids=position_ids)
    is_4d = isinstance(mask, torch.Tensor) and mask.dim() == 4
    return UlyssesInputs(
        input_ids=input_ids[:, start : start + local],
        position_ids=position_ids[:, start : start + local],
        model_attention_mask=mask if is_4d else None,
        call=call,
        start=start,
        full_len=full_len,
    )


def _pad_for_sp(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    sp: int,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Append columns up to a multiple of ``sp``: ids ``pad_token_id``, mask 0, positions ``0, 1, ...`` (in packed
    rows, a sequence of their own)."""
    rows, length = input_ids.shape
    extra = -length % sp
    if extra:
        input_ids = pad_to_multiple(input_ids, sp, pad_token_id)
        tail = torch.arange(extra, device=position_ids.device, dtype=position_ids.dtype)
        position_ids = torch.cat([position_ids, tail.expand(rows, extra)], dim=1)
        if attention_mask is not None:
            attention_mask = pad_to_multiple(attention_mask, sp, 0)
    return input_ids, position_ids, attention_mask


# ---------------------------------------------------------------------------------------------------------
# The attention wrapper
# ---------------------------------------------------------------------------------------------------------


class _LocalHeadsView:
    """The attention module as the wrapped attention function should see it on one rank.

    sdpa and eager read ``module.num_key_value_groups`` (query heads per KV head) to expand KV heads. After the
    all-to-all a rank holds ``heads / sp`` query heads; with replicated KV heads it holds one KV head, so the
    local ratio is ``heads / sp``, not the model's ``heads / kv_heads``. Everything else is the module's own.
    """

    def __init__(self, module: torch.nn.Module, groups: int):
        self.__dict__["_module"] = module
        self.__dict__["num_key_value_groups"] = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)


def _sp_attention(
    inner: Callable, call: UlyssesCall, module: torch.nn.Module, query, key, value, **kwargs
) -> tuple[torch.Tensor, Any]:
    if kwargs.get("sliding_window") is not None:
        raise ConfigError("Ulysses sequence parallelism does not support sliding-window attention layers")
    sp = dist.get_world_size(call.group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % sp or (kv_heads % sp and sp % kv_heads):
        raise ValueError(
            f"Ulysses SP over {sp} ranks needs query heads ({heads}) divisible by {sp} and KV heads "
            f"({kv_heads}) dividing or divisible by {sp}"
        )
    if kv_heads % sp:
        # Fewer KV heads than ranks: repeat each so rank r gets the KV head of its query heads
        # (query heads [r*h/sp, (r+1)*h/sp) all read KV head r*kv/sp).
        key = key.repeat_interleave(sp // kv_heads, dim=1)
        value = value.repeat_interleave(sp // kv_heads, dim=1)
    q_local, kv_local = heads // sp, key.shape[1] // sp
    if query.shape[-1] == key.shape[-1] == value.shape[-1]:
        # One all-to-all for q, k and v: lay each rank's q, k and v heads out side by side, so chunk r of the
        # head dimension is exactly what rank r needs.
        b, _, s, d = query.shape
        qkv = torch.cat(
            [t.reshape(b, sp, -1, s, d) for t in (query, key, value)], dim=2
        )  # [b, sp, q_local + 2 * kv_local, s, d]
        qkv = all_to_all(qkv.reshape(b, -1, s, d), call.group, scatter_dim=1, gather_dim=2)
        query, key, value = qkv.split([q_local, kv_local, kv_local], dim=1)
    else:
        query, key, value = (
            all_to_all(t, call.group, scatter_dim=1, gather_dim=2) for t in (query, key, value)
        )
    groups = q_local // kv_local
    target = (
        module
        if getattr(module, "num_key_value_groups", groups) == groups
        else _LocalHeadsView(module, groups)
    )
    kwargs["position_ids"] = call.position_ids  # flash attention reads packed-sequence boundaries from them
    out, weights = inner(target, query, key, value, call.attention_mask, **kwargs)  # out: [b, L', h/sp, d]
    call.layers_run += 1
    return all_to_all(out, call.group, scatter_dim=1, gather_dim=2), weights  # [b, L'/sp, h, d]


def _wrap(inner: Callable) -> Callable:
    def ulysses_attention_forward(module, query, key, value, attention_mask, **kwargs):
        call = kwargs.pop(KWARG, None)
        if call is None or dist.get_world_size(call.group) == 1:
            return inner(module, query, key, value, attention_mask, **kwargs)
        return _sp_attention(inner, call, module, query, key, value, **kwargs)

    setattr(ulysses_attention_forward, _WRAPPED_MARK, inner)
    return ulysses_attention_forward


def install_ulysses_attention() -> None:
    """Wrap transformers' registered ``sdpa`` and ``flash_attention_*`` functions (idempotent).

    The wrappers are pass-throughs unless a model call carries ``ulysses=UlyssesCall``, so installing them
    changes nothing for other models in the process. ``eager`` is not wrapped: it is each model's own
    module-level function, not an entry of the registry.
    """
    for name in list(ALL_ATTENTION_FUNCTIONS.keys()):
        if name != "sdpa" and not name.startswith("flash_attention"):
            continue
        fn = ALL_ATTENTION_FUNCTIONS[name]
        if not hasattr(fn, _WRAPPED_MARK):
            AttentionInterface.register(name, _wrap(fn))
