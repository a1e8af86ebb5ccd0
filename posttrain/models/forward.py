"""Forward passes over a RolloutBatch: per-token log-probs/entropy of the responses, and values.

Only the hidden states at response positions go through the LM head, so the logits tensor is
[B, R, V] rather than [B, P+R, V]: prompts can be long and vocabularies large.

How a pass is computed is set by one frozen :class:`ForwardOptions` per pass (built once from the config in
``posttrain.trainers.throughput``); no option changes what is computed, only how:

* ``remove_padding``: the micro-batch's real tokens (prompt + response of each row, no pads) are packed into
  rows with position ids restarting per sequence (:func:`packed_response_hidden_states`); the result is
  scattered back to the padded ``[b, R, ...]`` layout, so callers never see the difference.
* ``logprob_chunk_size`` / ``chunk_checkpoint``: log-probs and entropy come from the hidden states and the LM
  head weight ``chunk_size`` tokens at a time (:mod:`posttrain.models.chunked_head`), never as one
  ``[b * R, V]`` fp32 logits tensor; with ``chunk_checkpoint`` backward recomputes each chunk's logits.
* ``offload_activations``: tensors saved for backward by the transformer body go to (pinned) CPU memory
  during the forward, on CUDA only (:func:`activation_offload_context`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from posttrain.algorithms.logprobs import entropy_from_logits, logprobs_from_logits
from posttrain.batching.packing import pack_sequences
from posttrain.data.batch import RolloutBatch
from posttrain.models.chunked_head import chunked_logprobs_entropy
from posttrain.models.packed_forward import _uses_flash_attention, packed_causal_lm_forward
from posttrain.models.registry import PACKING_VERIFIED

# Logit transforms after the output projection that the chunked head cannot reproduce from hidden states.
_HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclass(frozen=True)
class ForwardOptions:
    """How one pass (actor update, old log-probs, reference, critic) runs. Every setting gives the same numbers.

    Attributes:
        remove_padding: pack each micro-batch's real tokens into rows (no pad tokens through the model).
        max_row_tokens: row capacity for packed rows with dense attention (sdpa/eager); raised to the longest
            sequence of the micro-batch when shorter. Ignored with flash-attention, where the whole micro-batch
            is one row (the varlen kernel's cost is ``sum(len_i ** 2)`` whatever the layout).
        logprob_chunk_size: tokens per chunk of the chunked log-prob/entropy head; None: full logits.
        chunk_checkpoint: with chunking, recompute each chunk's logits in backward (fused) instead of keeping
            every chunk's ``[chunk, V]`` tensors for autograd.
        offload_activations: move tensors saved for backward to CPU during the forward (CUDA only).
    """

    remove_padding: bool = False
    max_row_tokens: int = 512
    logprob_chunk_size: int | None = None
    chunk_checkpoint: bool = False
    offload_activations: bool = False


DEFAULT_OPTIONS = ForwardOptions()


def activation_offload_context(enabled: bool, device: torch.device | str) -> contextlib.AbstractContextManager:
    """``torch.autograd.graph.save_on_cpu(pin_memory=True)`` when ``enabled`` on a CUDA device, else a no-op.

    Tensors autograd saves inside the context are copied to pinned CPU memory and brought back in backward
    (the unpack hook travels with each saved tensor, so only the forward needs to run inside). On CPU the
    activations already live in CPU memory, so there is nothing to move.
    """
    if enabled and torch.device(device).type == "cuda":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
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
    """
    if options.remove_padding:
        return packed_response_hidden_states(model, batch, options)
    decoder = model.get_decoder()
    with _offload(options, batch):
        out = decoder(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,  # a cache object changes how transformers treats masks; never needed here
        )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    p, r = batch.prompt_width, batch.response_width
    return hidden[:, p - 1 : p - 1 + r]


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
    with _offload(options, batch):
        hidden = packed_causal_lm_forward(model, packed, output="hidden")  # [rows, L, H]
    device = hidden.device
    seq_rows = torch.tensor(packed.seq_rows, device=device)
    seq_starts = torch.tensor(packed.seq_starts, device=device)
    t = torch.arange(r, device=device)
    src = (seq_rows * packed.row_len + seq_starts + prompt_lens.to(device) - 1)[:, None] + t[None, :]  # [B, R]
    valid = t[None, :] < resp_lens.to(device)[:, None]  # [B, R]
    dst = torch.arange(batch.num_rows * r, device=device).view(batch.num_rows, r)
    h = hidden.shape[-1]
    gathered = hidden.reshape(-1, h).index_select(0, src[valid])
    out = hidden.new_zeros(batch.num_rows * r, h).index_copy(0, dst[valid], gathered)
    return out.view(batch.num_rows, r, h)


def lm_head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Apply the LM head (and any final logit soft-capping the architecture uses)."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def check_plain_lm_head(config, key: str = "actor.entropy_from_logits_with_chunking") -> None:
    """Raise ValueError (naming ``key``) unless logits are exactly ``hidden @ W.T (+ b)`` for this config.

    Soft-capped or scaled heads (Gemma 2/3, Cohere, Granite, ...) transform logits after the projection, which
    the chunked head cannot reproduce from hidden states. Works on a Hugging Face config, before any weights
    are loaded.
    """
    model_type = getattr(config, "model_type", "?")
    transforms = [name for name in _HEAD_TRANSFORMS if getattr(config, name, None) not in (None, 0, 1)]
    entry = PACKING_VERIFIED.get(model_type)
    if transforms or (entry is not None and not entry.plain_lm_head):
        what = ", ".join(transforms) or "registered with plain_lm_head=False"
        raise ValueError(
            f"{key}=true computes log-probs from hidden states and the LM head weight, but "
            f"model_type={model_type!r} transforms its logits after the projection ({what}), so the result "
            f"would be wrong. Set {key}=false for this model"
        )


def chunked_head_parameters(
    model: nn.Module, key: str = "actor.entropy_from_logits_with_chunking"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [V, H], bias [V] or None)`` of a plain linear LM head, for the chunked log-prob head.

    With tied embeddings the weight is the input embedding matrix itself, so its gradient gets both uses.
    """
    check_plain_lm_head(model.config, key)
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(
            f"{key}=true needs a linear output embedding; model_type={model.config.model_type!r} has none"
        )
    return head.weight, getattr(head, "bias", None)


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
    hidden = response_hidden_states(model, batch, options)
    b, r, h = hidden.shape
    flat_hidden, labels = hidden.reshape(b * r, h), batch.responses.reshape(-1)
    index = None
    if options.remove_padding:
        # Pad positions carry no token: skip them in the head too (the body never computed them).
        index = batch.attention_mask[:, batch.prompt_width :].reshape(-1).nonzero().squeeze(-1)
        flat_hidden, labels = flat_hidden.index_select(0, index), labels.index_select(0, index)
    if options.logprob_chunk_size is not None:
        weight, bias = chunked_head_parameters(model)
        logprobs, entropy = chunked_logprobs_entropy(
            flat_hidden, weight, labels, bias=bias, chunk_size=options.logprob_chunk_size,
            temperature=temperature, compute_entropy=with_entropy, checkpoint=options.chunk_checkpoint,
        )  # fmt: skip
    else:
        logits = lm_head_logits(model, flat_hidden).float()
        if temperature != 1.0:
            logits = logits / temperature
        logprobs = logprobs_from_logits(logits, labels)
        entropy = entropy_from_logits(logits) if with_entropy else None
    if index is not None:
        logprobs = _scatter_rows(logprobs, index, b * r)
        entropy = _scatter_rows(entropy, index, b * r) if entropy is not None else None
    return logprobs.view(b, r), (entropy.view(b, r) if entropy is not None else None)


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
    if options.remove_padding:
        hidden = packed_response_hidden_states(critic.backbone, batch, options)
        return critic.value_head(hidden.float()).squeeze(-1)
    with _offload(options, batch):
        values = critic(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        )
    p, r = batch.prompt_width, batch.response_width
    return values[:, p - 1 : p - 1 + r].float()
