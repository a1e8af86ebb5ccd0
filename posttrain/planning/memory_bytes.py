"""Byte counts of each piece of a training step's memory: model states (weights, gradients, optimizer moments),
activations of an update or a forward pass, the logits head, and the rollout engine's cache. Formulas only;
`posttrain.planning.memory` assembles them into per-phase estimates."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.models.lora import lora_settings
from posttrain.planning.shape import ModelShape

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32 = 4
# Elements saved for backward per token per decoder layer, beyond 11 x hidden + 4 x kv_dim + 4 x intermediate:
# one per attention head (the attention kernel's log-sum-exp). Counted with saved-tensor hooks on Qwen2 (sdpa).
HEAD_SAVED_LOGITS = (
    2.0  # naive head: fp32 logits + one more [N, V] tensor kept for backward (entropy's softmax)
)
HEAD_BACKWARD_LOGITS = 1.0  # naive head: the [N, V] gradient of the logits during backward
CHUNK_TENSORS = 2.0  # chunked head: [chunk, V] fp32 tensors alive at once (logits, probabilities)
FORWARD_HEAD_LOGITS = 2.0  # forward-only naive head: fp32 logits + one temporary of the same size


@dataclass(frozen=True)
class WhatIf:
    """Estimator inputs that override the config for every role ("what would it give"); ``None``: the config."""

    fsdp_size: int | None = None  # GPUs sharing one copy of params/grads/optimizer states (FSDP/HSDP group)
    param_offload: bool | None = None  # parameters, gradients, optimizer states in CPU memory (FSDP2 offload)
    optimizer_offload: bool | None = None  # AdamW moments in CPU memory between optimizer steps
    lora_rank: int = 0  # > 0: only LoRA adapters (all-linear) of the actor and critic are trained
    master_weights_fp32: bool | None = None  # FSDP mixed precision: fp32 master weights, grads and moments
    rollout_engine: str = "native"  # "native" (this project's) or "vllm"
    gpu_memory_utilization: float = 0.5  # vLLM: fraction of GPU memory it reserves for weights + KV cache
    max_num_seqs: int = 256  # vLLM: sequences decoded at once
    rollout_tp: int = 1  # vLLM: tensor-parallel size of the rollout engine

    def __post_init__(self) -> None:
        if self.fsdp_size is not None and self.fsdp_size < 1:
            raise ConfigError(f"fsdp size ({self.fsdp_size}) must be >= 1 (1: no sharding)")
        if self.lora_rank < 0:
            raise ConfigError(f"LoRA rank ({self.lora_rank}) must be >= 0 (0: full fine-tuning)")
        if self.rollout_engine not in ("native", "vllm"):
            raise ConfigError(f"rollout engine {self.rollout_engine!r} must be 'native' or 'vllm'")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization ({self.gpu_memory_utilization}) must be in (0, 1]")


# --- model states ------------------------------------------------------------------------------------------


def parameter_bytes(
    shape: ModelShape, dtype_bytes: int, shard: int, offload: bool, compute_bytes: int
) -> int:
    """Weights on one GPU: all parameters / ``shard`` in ``dtype_bytes``; with offload none of them.

    Sharded, offloaded or mixed-precision weights are gathered (cast to the compute dtype) one decoder layer at
    a time, plus one prefetched layer: two unsharded layers on the GPU. Ignores buffers (RoPE tables) and the
    allocator's rounding.
    """
    gathered = (
        2 * shape.layer_params() * compute_bytes
        if (shard > 1 or offload or dtype_bytes != compute_bytes)
        else 0
    )
    if offload:
        return gathered
    return shape.num_params() * dtype_bytes // shard + gathered


@dataclass(frozen=True)
class Training:
    """What a trained role updates: every weight (``lora_rank == 0``) or LoRA adapters of these targets."""

    lora_rank: int = 0
    target_modules: tuple[str, ...] = ("all-linear",)


FULL = Training()


def trainable_params(
    shape: ModelShape, lora_rank: int, target_modules: tuple[str, ...] = ("all-linear",)
) -> int:
    """Parameters that get gradients and optimizer states: all, or only the LoRA adapters."""
    return shape.lora_params(lora_rank, target_modules) if lora_rank > 0 else shape.num_params()


def role_training(cfg: PostTrainConfig, w: WhatIf, role: str) -> Training:
    """The actor trains LoRA adapters with ``model.lora_rank`` (or a saved adapter's rank); ``WhatIf.lora_rank``
    asks "what if" for the actor and the critic alike (all-linear) and wins when set."""
    if w.lora_rank > 0:
        return Training(w.lora_rank)
    if role != "actor":
        return FULL

    settings = lora_settings(cfg)
    return Training(settings.rank, settings.target_modules) if settings is not None else FULL


def gradient_bytes(trainable: int, grad_bytes: int, shard: int, offload: bool) -> int:
    """Gradients of the trainable parameters, sharded like them (FSDP reduce-scatters them); in CPU memory
    with parameter offload.

    Ignores the unsharded gradient of the layer being reduced and communication buckets.
    """
    return 0 if offload else trainable * grad_bytes // shard


def optimizer_bytes(trainable: int, state_bytes: int, shard: int) -> int:
    """AdamW's two moments, in the parameters' dtype, sharded like them (fp32 master weights, when kept, are the
    parameters themselves and counted with the weights)."""
    return trainable * 2 * state_bytes // shard


# --- activations ------------------------------------------------------------------------------------------


def layer_saved_elements_per_token(shape: ModelShape, training: Training | None = None) -> int:
    """Elements one decoder layer saves for backward per token (Llama/Qwen2 with sdpa/flash attention).

    Counted with saved-tensor hooks on a Qwen2 layer: two RMSNorms (input + output each: 4 x hidden), q and its
    RoPE copies (3 x hidden), K/V projections, RoPE'd K and the GQA-repeated K/V (4 x kv_dim + 2 x hidden), the
    attention output and its o_proj input (2 x hidden), the gated MLP (gate, up, SiLU, product: 4 x
    intermediate), and one log-sum-exp per head. Ignores attention-probability matrices: an eager (non-fused)
    attention would add heads x sequence length per token.

    With LoRA (``training.lora_rank > 0``) the RMSNorm weights are frozen, so each norm no longer keeps its
    normalised input for a weight gradient (2 x hidden fewer); each adapted matrix keeps its adapter's rank-wide
    intermediate ``A x`` (rank more per adapted matrix). The adapters' input is the same tensor the base layer
    reads, saved once. Measured the same way: about 10% fewer elements than full fine-tuning at rank 32.
    """
    training = training or FULL
    full = 11 * shape.hidden_size + 4 * shape.kv_dim + 4 * shape.intermediate_size + shape.num_heads
    if training.lora_rank == 0:
        return full
    matrices = shape.lora_matrices_per_layer(training.target_modules)
    return full - 2 * shape.hidden_size + training.lora_rank * matrices


def update_activation_bytes(
    shape: ModelShape,
    tokens: int,
    dtype_bytes: int,
    checkpointing: bool,
    offload: bool,
    training: Training | None = None,
) -> int:
    """Activations a training micro-batch of ``tokens`` tokens keeps on the GPU at the start of backward.

    Plain: every layer's saved tensors. Gradient checkpointing: each layer's input (hidden x tokens) plus one
    layer recomputed in backward. Activation offload (CUDA): saved tensors live in CPU memory, so the GPU holds
    about one layer's worth (the one being computed). Ignores the embedding output and rotary tables.
    """
    one_layer = tokens * layer_saved_elements_per_token(shape, training or FULL) * dtype_bytes
    if offload:
        return one_layer
    if checkpointing:
        return shape.num_layers * tokens * shape.hidden_size * dtype_bytes + one_layer
    return shape.num_layers * one_layer


def narrowed_last_mlp_bytes(shape: ModelShape, tokens: int, response_tokens: int, dtype_bytes: int) -> int:
    """What the padded forward does not save: its last decoder layer's MLP (gate, up, SiLU, product:
    4 x intermediate per token) runs on the columns that predict response tokens only
    (``posttrain.forward.passes._last_mlp_from``), not on the prompt columns."""
    return max(tokens - response_tokens, 0) * 4 * shape.intermediate_size * dtype_bytes


def update_step_bytes(activations: int, gradients: int, optimizer_for_step: int = 0) -> int:
    """Activations and gradients at the backward's peak: backward frees each layer's saved activations as it
    creates that layer's gradients, so the peak is the larger of the two (measured on CPU: they do not add up).
    With optimizer offload the moments come back to the GPU for the optimizer step, next to the gradients.
    Ignores gradient-communication buckets (FSDP/DDP), which are small next to either."""
    return max(activations, gradients + optimizer_for_step)


def head_update_bytes(
    response_tokens: int, vocab: int, dtype_bytes: int, chunk: int | None, checkpoint: bool
) -> int:
    """The log-prob + entropy head of a training micro-batch (only response positions go through the head).

    Naive: fp32 logits and one more ``[N, V]`` tensor are saved, and backward adds the logits' gradient
    (``HEAD_SAVED_LOGITS + HEAD_BACKWARD_LOGITS`` x ``[N, V]`` fp32, plus the ``model.dtype`` logits before the
    cast when that is not fp32). Chunked with recompute (``entropy_checkpointing``): a few ``[chunk, V]`` fp32
    tensors, independent of N. Chunked without recompute: every chunk's tensors stay for autograd (about as
    much as naive). Ignores the head's weight gradient (counted in gradients).
    """
    nv = response_tokens * vocab
    cast = nv * dtype_bytes if dtype_bytes != FP32 else 0
    if chunk is None or not checkpoint:
        return int(nv * FP32 * (HEAD_SAVED_LOGITS + HEAD_BACKWARD_LOGITS)) + cast
    return int(min(chunk, response_tokens) * vocab * FP32 * CHUNK_TENSORS)


def forward_only_bytes(
    shape: ModelShape, tokens: int, response_tokens: int, dtype_bytes: int, chunk: int | None, lm_head: bool
) -> int:
    """Working memory of a forward-only micro-batch (old/reference log-probs, values): nothing is saved, so
    the peak is the residual stream plus the largest single step, a decoder layer's MLP (hidden states in and
    out, gate/up/product: ``4 x hidden + 3 x intermediate`` per token) or the log-prob head (``[N, V]`` fp32
    logits + one temporary; ``[chunk, V]`` when chunked). ``lm_head=False`` for the critic (a scalar head)."""
    layer = tokens * (4 * shape.hidden_size + 3 * shape.intermediate_size) * dtype_bytes
    if not lm_head:
        return layer
    rows = response_tokens if chunk is None else min(chunk, response_tokens)
    head = (
        int(rows * shape.vocab_size * FP32 * FORWARD_HEAD_LOGITS) + tokens * shape.hidden_size * dtype_bytes
    )
    return max(layer, head)


# --- rollout ---------------------------------------------------------------------------------------------


def kv_cache_bytes(shape: ModelShape, sequences: int, tokens_per_sequence: int, dtype_bytes: int) -> int:
    """K and V of every layer for ``sequences`` x ``tokens_per_sequence`` tokens (GQA: kv_dim wide)."""
    return 2 * shape.num_layers * shape.kv_dim * sequences * tokens_per_sequence * dtype_bytes


def native_rollout_bytes(
    shape: ModelShape, slots: int, tokens_per_slot: int, tokens_per_forward: int, dtype_bytes: int
) -> tuple[int, int]:
    """(KV cache, working memory) of this project's engine. The cache is preallocated: ``rollout.max_num_seqs``
    slots of the longest prompt + ``max_response_length`` tokens each. One forward carries at most
    ``rollout.max_num_batched_tokens`` tokens (decode tokens + prefill chunks) through one layer's MLP working
    set at a time, and samples from the logits of at most one row per slot. Ignores the simpler path for
    architectures the slot cache does not support (a growing cache of ``chunk_size x n`` sequences)."""
    kv = kv_cache_bytes(shape, slots, tokens_per_slot, dtype_bytes)
    forward = tokens_per_forward * (4 * shape.hidden_size + 3 * shape.intermediate_size) * dtype_bytes
    sampling = 3 * slots * shape.vocab_size * FP32
    return kv, forward + sampling


def vllm_rollout(shape: ModelShape, gpu_bytes: int, what_if: WhatIf, seq_len: int, dtype_bytes: int) -> dict:
    """What a vLLM engine would reserve: ``gpu_memory_utilization`` x GPU memory for its weights (split over
    ``rollout_tp`` GPUs) and KV cache, and how many sequences of ``seq_len`` tokens that cache holds
    (``max_num_seqs`` caps it). Ignores CUDA graphs, vLLM's activation profiling and fragmentation."""
    reserved = int(what_if.gpu_memory_utilization * gpu_bytes)
    weights = shape.num_params() * dtype_bytes // what_if.rollout_tp
    per_seq = kv_cache_bytes(shape, 1, seq_len, dtype_bytes) // what_if.rollout_tp
    kv = max(0, reserved - weights)
    return {
        "reserved_bytes": reserved,
        "weights_bytes": weights,
        "kv_cache_bytes": kv,
        "max_concurrent_seqs": min(what_if.max_num_seqs, kv // max(per_seq, 1)),
    }
