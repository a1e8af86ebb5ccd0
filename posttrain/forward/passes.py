"""Forward passes over a RolloutBatch: per-token log-probs/entropy of the responses, and values.

Only the hidden states at response positions go through the LM head, so the logits tensor is
[B, R, V] rather than [B, P+R, V]: prompts can be long and vocabularies large.

How a pass is computed is set by one frozen :class:`ForwardOptions` per pass (built once from the config in
``posttrain.models.prepare``); no option changes what is computed, only how:

* ``remove_padding``: the micro-batch's real tokens (prompt + response of each row, no pads) are packed into
  rows with position ids restarting per sequence (:func:`packed_response_hidden_states`); the result is
  scattered back to the padded ``[b, R, ...]`` layout, so callers never see the difference.
* ``logprob_chunk_size`` / ``chunk_checkpoint``: log-probs and entropy come from the hidden states and the LM
  head weight ``chunk_size`` tokens at a time (:mod:`posttrain.forward.chunked_head`), never as one
  ``[b * R, V]`` fp32 logits tensor; with ``chunk_checkpoint`` backward recomputes each chunk's logits.
* ``offload_activations``: tensors saved for backward by the transformer body go to (pinned) CPU memory
  during the forward, on CUDA only (:func:`activation_offload_context`).
* ``prefix_grouper``: the rows of a micro-batch that share a prompt run it once: one flat row of unique tokens
  (each prompt, then its responses with positions restarting at the prompt length) whose attention runs per
  sequence (:mod:`posttrain.forward.prefix_grouper`, :mod:`posttrain.forward.shared_prefix`); no padding at
  all, so ``remove_padding`` is moot.
* ``sp_group``: Ulysses sequence parallelism (:mod:`posttrain.parallel.ulysses`). Every rank of the group
  passes the same micro-batch; each runs the body on its slice of the (padded or packed) sequence, computes
  log-probs/values at the response positions it holds, and the per-token results are gathered, so every rank
  returns the full ``[B, R]`` tensors (:func:`_sp_response_outputs`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from posttrain.algorithms.logprobs import logprobs_and_entropy, logprobs_from_logits
from posttrain.batching.packing import PackedBatch, pack_sequences
from posttrain.config.errors import ConfigError
from posttrain.data.batch import RolloutBatch
from posttrain.forward.chunked_head import chunked_logprobs_entropy
from posttrain.forward.lm_head import chunked_head_parameters, lm_head_logits
from posttrain.forward.offload import OffloadActivations
from posttrain.forward.packed import _uses_flash_attention, packed_causal_lm_forward
from posttrain.forward.prefix_grouper import group_by_prompt
from posttrain.forward.shared_prefix import (
    SHARED_PREFIX_ATTENTION,
    SharedPrefixPlan,
    register_shared_prefix_attention,
)
from posttrain.models.registry import check_packing_supported
from posttrain.parallel import ulysses


@dataclass(frozen=True)
class ForwardOptions:
    """How one pass (actor update, old log-probs, reference, critic) runs. Every setting gives the same numbers.

    Attributes:
        remove_padding: pack each micro-batch's real tokens into rows (no pad tokens through the model).
        max_row_tokens: row capacity for packed rows with dense attention (sdpa/eager); raised to the longest
            sequence of the micro-batch when shorter. Not used by ``prefix_grouper`` (one flat row, attention
            per sequence). Ignored with flash-attention, where the whole micro-batch
            is one row (the varlen kernel's cost is ``sum(len_i ** 2)`` whatever the layout).
        logprob_chunk_size: tokens per chunk of the chunked log-prob/entropy head; None: full logits.
        chunk_checkpoint: with chunking, recompute each chunk's logits in backward (fused) instead of keeping
            every chunk's ``[chunk, V]`` tensors for autograd.
        offload_activations: move tensors saved for backward to CPU during the forward (CUDA only).
        prefix_grouper: compute each distinct prompt of a micro-batch once for all its responses
            (sdpa/eager attention; not with ``sp_group``).
        sp_group: the Ulysses sequence-parallel group this rank belongs to; None (or a group of one): no SP.
            The ranks' parameter gradients sum to the gradient of the (shared) loss.
    """

    remove_padding: bool = False
    max_row_tokens: int = 512
    logprob_chunk_size: int | None = None
    chunk_checkpoint: bool = False
    offload_activations: bool = False
    prefix_grouper: bool = False
    sp_group: dist.ProcessGroup | None = field(default=None, compare=False, hash=False)


DEFAULT_OPTIONS = ForwardOptions()


def activation_offload_context(
    enabled: bool, device: torch.device | str
) -> contextlib.AbstractContextManager:
    """:class:`OffloadActivations` when ``enabled`` on a CUDA device, else a no-op.

    Tensors autograd saves inside the context are copied to pinned CPU memory and brought back in backward
    (the unpack hook travels with each saved tensor, so only the forward needs to run inside). On CPU the
    activations already live in CPU memory, so there is nothing to move.
    """
    if enabled and torch.device(device).type == "cuda":
        return OffloadActivations()
    return contextlib.nullcontext()


def _offload(options: ForwardOptions, batch: RolloutBatch) -> contextlib.AbstractContextManager:
    return activation_offload_context(
        options.offload_activations and torch.is_grad_enabled(), batch.input_ids.device
    )


def response_hidden_states(
    model: nn.Module, batch: RolloutBatch, options: ForwardOptions = DEFAULT_OPTIONS
) -> torch.Tensor:
    """[B, R, H] final hidden states at the positions that predict each response token.

    Padded: the left/right padded batch with its attention mask. ``options.remove_padding``: the packed
    forward (:func:`packed_response_hidden_states`), zeros where a row has no response token.
    ``options.prefix_grouper``: the shared-prompt forward (:func:`grouped_response_hidden_states`), likewise.
    """
    if options.prefix_grouper:
        return grouped_response_hidden_states(model, batch, options)
    if options.remove_padding:
        return packed_response_hidden_states(model, batch, options)
    decoder = model.get_decoder()
    p, r = batch.prompt_width, batch.response_width
    end = _predicting_positions(batch)
    with _offload(options, batch), _last_mlp_from(decoder, p - 1):
        out = decoder(
            input_ids=batch.input_ids[:, :end],
            attention_mask=batch.attention_mask[:, :end],
            position_ids=batch.position_ids[:, :end],
            use_cache=False,  # a cache object changes how transformers treats masks; never needed here
        )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[:, p - 1 : p - 1 + r]


def _predicting_positions(batch: RolloutBatch) -> int:
    """How many leading positions of the padded layout predict a response token: all but the last.

    Why: response token t is predicted at position ``p - 1 + t`` (t < R), so the last position's output is never
    read, and under causal attention no other position sees it, so the body skips it: one of the ``P + R``
    columns of the forward and backward (2% of the update with 18-token prompts and 32-token responses). Same
    numbers up to float rounding (kernels see one column fewer).
    """
    return batch.prompt_width + batch.response_width - 1


@contextlib.contextmanager
def _last_mlp_from(decoder: nn.Module, start: int):
    """Run the last decoder layer's MLP on columns ``[start, end)`` only, while the context is open.

    Why: only the positions predicting response tokens (from ``prompt_width - 1``) are read from the body's
    output, and nothing attends to the last layer's output, so its MLP (three quarters of a layer's matmul
    work) is wasted on the prompt columns; their outputs become zeros, which nobody reads. With 18-token
    prompts, 32-token responses and 4 layers that is 8% of the body's forward and backward. Same numbers up to
    float rounding. Only a dense, per-token MLP (a class named ``*MLP``, called with the hidden states alone)
    is narrowed: a mixture of experts routes on the batch, and gradient checkpointing re-runs the layer in
    backward without this context; both are left alone.
    """
    layers = getattr(decoder, "layers", None)
    mlp = getattr(layers[-1], "mlp", None) if layers is not None and len(layers) else None
    dense = mlp is not None and type(mlp).__name__.endswith("MLP")
    if start <= 0 or not dense or getattr(decoder, "gradient_checkpointing", False):
        yield
        return
    narrowed = []

    def narrow(module, args, kwargs):
        (hidden,) = args if len(args) == 1 and not kwargs else (None,)
        if hidden is None or hidden.dim() != 3 or hidden.shape[1] <= start:
            return None
        narrowed.append(True)
        return (hidden[:, start:],), {}

    def widen(module, args, kwargs, out):
        if narrowed and narrowed.pop():
            return torch.nn.functional.pad(out, (0, 0, start, 0))
        return None

    handles = [
        mlp.register_forward_pre_hook(narrow, with_kwargs=True),
        mlp.register_forward_hook(widen, with_kwargs=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def packed_response_hidden_states(
    model: nn.Module, batch: RolloutBatch, options: ForwardOptions = DEFAULT_OPTIONS
) -> torch.Tensor:
    """[B, R, H] hidden states from a packed forward, aligned exactly like :func:`response_hidden_states`.

    Each row's real tokens (prompt + response, pads dropped) become one sequence; sequences are packed into
    rows of at most ``options.max_row_tokens`` tokens (one row with flash-attention) with position ids
    restarting at 0, run with ``attention_mask=None, use_cache=False`` (what makes transformers keep
    attention inside each sequence), and the states at the positions predicting response tokens are scattered
    back to ``[B, R, H]``: response token t of row i is predicted at sequence position ``prompt_len_i - 1 + t``.
    Positions past a row's response are zeros (they are masked by ``response_mask`` everywhere).

    ``model``: a causal LM or a bare backbone (``get_decoder()`` returns the transformer body either way).
    """
    layout = _packed_layout(model, batch, options)
    with _offload(options, batch):
        hidden = packed_causal_lm_forward(model, layout.packed, output="hidden")  # [rows, L, H]
    return _at_responses(hidden, layout)


def grouped_response_hidden_states(
    model: nn.Module, batch: RolloutBatch, options: ForwardOptions = DEFAULT_OPTIONS
) -> torch.Tensor:
    """[B, R, H] hidden states from the shared-prompt forward (:mod:`posttrain.forward.prefix_grouper`), aligned
    exactly like :func:`response_hidden_states`; zeros past a row's response."""
    layout, plan = _grouped_layout(model, batch)
    with _offload(options, batch):
        out = model.get_decoder()(
            input_ids=layout.input_ids,
            # A 4-D mask is used as given (transformers builds none); this empty one is never read: the
            # shared-prefix attention takes its masks from the plan.
            attention_mask=torch.empty(1, 1, 0, 0, dtype=torch.bool, device=layout.input_ids.device),
            position_ids=layout.position_ids,
            use_cache=False,
            shared_prefix=plan,
        )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return _at_responses(hidden, layout)


@dataclass(frozen=True)
class _Layout:
    """A micro-batch as model inputs, and where the prediction of each response token sits in them.

    ``rows``/``cols`` ``[B, R]``: the row and column of the position predicting response token t of sample i
    (entries beyond a row's response are meaningless where ``valid`` is False); ``valid`` None: all entries.
    """

    input_ids: torch.Tensor  # [rows, L]
    position_ids: torch.Tensor  # [rows, L]
    attention_mask: torch.Tensor | None  # [rows, L] padded rows; None packed or grouped rows
    rows: torch.Tensor  # [B, R] long
    cols: torch.Tensor  # [B, R] long
    valid: torch.Tensor | None  # [B, R] bool
    packed: PackedBatch | None = None


def _padded_layout(batch: RolloutBatch) -> _Layout:
    b, p, r = batch.num_rows, batch.prompt_width, batch.response_width
    device = batch.input_ids.device
    rows = torch.arange(b, device=device)[:, None].expand(b, r)
    cols = (p - 1 + torch.arange(r, device=device))[None, :].expand(b, r)
    return _Layout(batch.input_ids, batch.position_ids, batch.attention_mask, rows, cols, None)


def _packed_layout(model: nn.Module, batch: RolloutBatch, options: ForwardOptions) -> _Layout:
    """Each row's real tokens (prompt + response) as one sequence, packed into rows (see
    :func:`packed_response_hidden_states`); response token t of sample i is predicted at position
    ``prompt_len_i - 1 + t`` of its sequence."""
    real = batch.attention_mask.bool()
    p, r = batch.prompt_width, batch.response_width
    prompt_lens = real[:, :p].sum(-1)  # [B]
    resp_lens = real[:, p:].sum(-1)  # [B]
    if bool(((prompt_lens == 0) & (resp_lens > 0)).any()):
        raise ValueError("a row has response tokens but no prompt token: nothing predicts its first token")
    seqs = [batch.input_ids[i][real[i]] for i in range(batch.num_rows)]
    longest = max(len(s) for s in seqs)
    cap = None if _uses_flash_attention(model) else max(options.max_row_tokens, longest)
    packed = pack_sequences(seqs, cap, pad_token_id=0)  # row tails are their own segment: any id works
    device = batch.input_ids.device
    t = torch.arange(r, device=device)
    seq_rows = torch.tensor(packed.seq_rows, device=device)
    seq_starts = torch.tensor(packed.seq_starts, device=device)
    rows = seq_rows[:, None].expand(batch.num_rows, r)
    cols = (seq_starts + prompt_lens.to(device) - 1)[:, None] + t[None, :]
    valid = t[None, :] < resp_lens.to(device)[:, None]
    return _Layout(packed.input_ids, packed.position_ids, None, rows, cols, valid, packed)


def _grouped_layout(model: nn.Module, batch: RolloutBatch) -> tuple[_Layout, SharedPrefixPlan]:
    """The micro-batch as the prefix grouper's flat row of unique tokens, and its attention plan."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == "sdpa":
        # The shared-prefix attention is sdpa in every call without a plan: switching is invisible elsewhere.
        model.config._attn_implementation = register_shared_prefix_attention()
    elif impl != SHARED_PREFIX_ATTENTION:
        raise ValueError(
            f"the prefix grouper needs the model loaded with attn_implementation={SHARED_PREFIX_ATTENTION!r} "
            f"(posttrain.forward.shared_prefix.register_shared_prefix_attention()) or 'sdpa', it uses {impl!r}"
        )
    groups = group_by_prompt(batch)
    layout = _Layout(groups.input_ids, groups.position_ids, None, groups.rows, groups.cols, groups.valid)
    return layout, groups.attention


def _at_responses(per_position: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """``[B, R, ...]`` from ``[rows, L, ...]`` at the layout's response predictions; 0 where not valid."""
    if layout.valid is None:
        return per_position[layout.rows, layout.cols]
    valid = layout.valid
    picked = per_position[layout.rows[valid], layout.cols[valid]]
    out = per_position.new_zeros((*valid.shape, *per_position.shape[2:]))
    return out.index_put((valid,), picked)


def policy_logprobs(
    model: nn.Module,
    batch: RolloutBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    options: ForwardOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, R] of the response tokens (and entropy [B, R]) under `model` at `temperature`.

    Temperature divides the logits as in the sampler, so old/new log-probs describe the
    distribution the rollout actually sampled from (verl does the same). With ``options.remove_padding``
    only real response positions go through the head and the other entries are 0 (masked everywhere).
    """
    if _sp_size(options) > 1:
        head = lambda h, y: _logprobs_from_hidden(model, h, y, temperature, with_entropy, options)  # noqa: E731
        logprobs, entropy = _sp_response_outputs(model.get_decoder(), batch, options, head)
        return logprobs, entropy
    hidden = response_hidden_states(model, batch, options)
    return logprobs_from_response_hidden(model, batch, hidden, temperature, with_entropy, options)


def logprobs_from_response_hidden(
    model: nn.Module,
    batch: RolloutBatch,
    hidden: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    options: ForwardOptions,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`policy_logprobs` from :func:`response_hidden_states`' ``[B, R, H]`` (for a loss that reads the
    hidden states too: the GKD term)."""
    b, r, h = hidden.shape
    flat_hidden, labels = hidden.reshape(b * r, h), batch.responses.reshape(-1)
    index = None
    if options.remove_padding or options.prefix_grouper:
        # Pad positions carry no token: skip them in the head too (the body never computed them).
        index = batch.attention_mask[:, batch.prompt_width :].reshape(-1).nonzero().squeeze(-1)
        flat_hidden, labels = flat_hidden.index_select(0, index), labels.index_select(0, index)
    logprobs, entropy = _logprobs_from_hidden(model, flat_hidden, labels, temperature, with_entropy, options)
    if index is not None:
        logprobs = _scatter_rows(logprobs, index, b * r)
        entropy = _scatter_rows(entropy, index, b * r) if entropy is not None else None
    return logprobs.view(b, r), (entropy.view(b, r) if entropy is not None else None)


def _logprobs_from_hidden(
    model: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    options: ForwardOptions,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[N]`` of ``labels`` (and entropy ``[N]``) from final hidden states ``[N, H]``."""
    if options.logprob_chunk_size is not None:
        weight, bias = chunked_head_parameters(model)
        return chunked_logprobs_entropy(
            hidden,
            weight,
            labels,
            bias=bias,
            chunk_size=options.logprob_chunk_size,
            temperature=temperature,
            compute_entropy=with_entropy,
            checkpoint=options.chunk_checkpoint,
        )
    logits = lm_head_logits(model, hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    if with_entropy:
        return logprobs_and_entropy(logits, labels)
    return logprobs_from_logits(logits, labels), None


def _scatter_rows(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """[N] values at ``index`` of a zero [size] tensor (differentiable)."""
    return values.new_zeros(size).index_copy(0, index, values)


def critic_values(
    critic: nn.Module, batch: RolloutBatch, options: ForwardOptions = DEFAULT_OPTIONS
) -> torch.Tensor:
    """Values [B, R] at the positions that predict each response token (verl's convention).

    ``critic`` is a :class:`posttrain.models.critic.CriticModel`; with ``options.remove_padding`` its backbone
    runs packed and the value head reads the scattered-back states (0-state entries are masked).
    """
    if _sp_size(options) > 1:
        head = lambda h, _labels: (critic.value_head(h.float()).squeeze(-1),)  # noqa: E731
        (values,) = _sp_response_outputs(critic.backbone, batch, options, head)
        return values
    if options.remove_padding or options.prefix_grouper:
        hidden = response_hidden_states(critic.backbone, batch, options)
        return critic.value_head(hidden.float()).squeeze(-1)
    end = _predicting_positions(batch)
    with _offload(options, batch):
        values = critic(
            input_ids=batch.input_ids[:, :end],
            attention_mask=batch.attention_mask[:, :end],
            position_ids=batch.position_ids[:, :end],
        )
    p, r = batch.prompt_width, batch.response_width
    return values[:, p - 1 : p - 1 + r].float()


def _sp_size(options: ForwardOptions) -> int:
    return 1 if options.sp_group is None else dist.get_world_size(options.sp_group)


# [N, H] hidden states, [N] labels -> per-token outputs ([N] each, or None)
_Head = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor | None, ...]]


def _sp_response_outputs(
    body: nn.Module, batch: RolloutBatch, options: ForwardOptions, head: _Head
) -> list[torch.Tensor | None]:
    """Ulysses SP forward: each ``[B, R]`` output of ``head`` at the response predictions, on every rank.

    The padded or packed layout of the micro-batch is padded to a multiple of the SP size and sliced; this
    rank runs the body on its slice (attention sees the full sequence through the all-to-alls) and the head on
    the response predictions it holds; the per-token results are gathered along the sequence. Outside valid
    response positions the entries are 0.
    """
    group = options.sp_group
    if options.prefix_grouper:
        raise ConfigError(
            "actor.use_prefix_grouper=true cannot be combined with Ulysses sequence parallelism"
        )
    if options.remove_padding:
        check_packing_supported(body.config)
        layout = _packed_layout(body, batch, options)
    else:
        layout = _padded_layout(batch)
    dtype = body.get_input_embeddings().weight.dtype
    inputs = ulysses.shard_inputs(
        body.config, layout.input_ids, layout.position_ids, layout.attention_mask, group, dtype=dtype
    )
    with _offload(options, batch):
        out = body(**inputs.model_kwargs())
    inputs.check_attention_ran()
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [rows, L'/sp, H]
    lo, n = inputs.start, inputs.local_len
    mine = (layout.cols >= lo) & (layout.cols < lo + n)
    if layout.valid is not None:
        mine &= layout.valid
    rows, cols, labels = layout.rows[mine], layout.cols[mine] - lo, batch.responses[mine]
    placeholder = rows.numel() == 0
    if placeholder:
        # No response prediction on this rank: run the head on one position anyway, with a zero weight, so
        # that this rank's backward still runs through the body and the head; the other ranks' backward
        # all-to-alls wait for it, and a parameter without a gradient here would desynchronise the
        # data-parallel gradient reduction.
        rows, cols, labels = (torch.zeros(1, dtype=torch.long, device=hidden.device) for _ in range(3))
    results: list[torch.Tensor | None] = []
    for values in head(hidden[rows, cols], labels):
        if values is None:
            results.append(None)
            continue
        if placeholder:
            values = values * 0
        local = values.new_zeros(hidden.shape[0], n).index_put((rows, cols), values)
        full = ulysses.gather_sequence(local, group, dim=1)  # [rows, L']
        results.append(_at_responses(full, layout))
    return results
