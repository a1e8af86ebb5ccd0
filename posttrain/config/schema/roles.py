"""The trained and frozen roles: sharding, optimizer, actor, reference, critic."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.fields import knob, section
from posttrain.config.schema.names import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES


@dataclass
class ShardingConfig:
    """How a role's model is sharded over the ranks with FSDP2 (used when launched with torchrun)."""

    fsdp_size: int = knob(
        -1,
        "Ranks each model is sharded over: -1 shards over all ranks; k shards within groups of k ranks and "
        "replicates across groups (HSDP; k must divide the world size).",
        unit="ranks",
        min=-1,
    )
    param_offload: bool = knob(
        False,
        "Keep the sharded parameters (and gradients) in CPU memory, copying each layer to the GPU for its "
        "forward/backward (FSDP2 CPUOffloadPolicy). CUDA only: no effect on CPU (a warning says so).",
    )
    forward_prefetch: bool = knob(
        False,
        "Start gathering the next decoder layer's parameters while the current layer computes (FSDP2 "
        "explicit prefetching), in forward and backward.",
    )
    reshard_after_forward: bool = knob(
        True,
        "Free each layer's gathered parameters after its forward (gathered again in backward): ZeRO-3 "
        "memory. False keeps them until backward (ZeRO-2-like: more memory, fewer all-gathers).",
    )


@dataclass
class FSDPConfig(ShardingConfig):
    """Sharding of a trained role (actor, critic): adds the optimizer state's placement."""

    optimizer_offload: bool = knob(
        False,
        "Keep the optimizer state (Adam moments) in CPU memory between optimizer steps; it is moved to the "
        "GPU for each step. CUDA only: no effect on CPU.",
    )


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = knob(1e-5, "Peak learning rate.", min=0.0)
    weight_decay: float = knob(0.0, "AdamW weight decay.", min=0.0)
    betas: list[float] = knob(
        default_factory=lambda: [0.9, 0.999], help="AdamW betas: two numbers, each in [0, 1)."
    )
    eps: float = knob(1e-8, "AdamW epsilon, added to the denominator (> 0).", min=0.0)
    warmup_steps: int = knob(0, "Linear warm-up length.", unit="optimizer steps", min=0)
    lr_schedule: str = knob("constant", "Schedule after warm-up.", choices=("constant", "cosine", "linear"))
    min_lr_ratio: float = knob(0.0, "Final lr / peak lr for cosine and linear schedules.", min=0.0, max=1.0)
    grad_clip: float = knob(1.0, "Clip the global gradient norm to this value (0 disables).", min=0.0)


@dataclass
class ActorConfig:
    """The policy update (PPO/GRPO loss) and the actor's forward-only pass for old log-probs."""

    ppo_mini_batch_size: int = knob(
        16,
        "Prompts per optimizer step (global; x rollout.n samples). A prompt's samples stay in one "
        "mini-batch, so group statistics are never split.",
        unit="prompts",
        min=1,
    )
    ppo_micro_batch_size_per_gpu: int = knob(
        64, "Samples per forward/backward pass on one DP rank.", unit="samples per DP rank", min=1
    )
    ppo_epochs: int = knob(1, "Passes over each step's samples.", unit="epochs", min=1)
    shuffle: bool = knob(
        True, "Shuffle samples between epochs (groups stay whole); False keeps the rollout order."
    )
    use_dynamic_bsz: bool = knob(
        False,
        "Form micro-batches by token budget instead of count (ignores the *_micro_batch_size_per_gpu "
        "keys of the actor and the reference policy).",
    )
    ppo_max_token_len_per_gpu: int = knob(
        16384,
        "Token budget of one training micro-batch when use_dynamic_bsz is on.",
        unit="tokens per GPU",
        min=1,
    )
    log_prob_micro_batch_size_per_gpu: int = knob(
        64,
        "Samples per forward-only pass computing old log-probs (may exceed the training micro size).",
        unit="samples per DP rank",
        min=1,
    )
    log_prob_max_token_len_per_gpu: int = knob(
        32768,
        "Token budget of one old-log-prob forward pass when use_dynamic_bsz is on.",
        unit="tokens per GPU",
        min=1,
    )
    ulysses_sequence_parallel_size: int = knob(
        1, "GPUs sharing each sequence (Ulysses); DP size = world size / this.", unit="GPUs", min=1
    )
    use_prefix_grouper: bool | None = knob(
        None,
        "Run each prompt once for all its samples in a micro-batch (one row of unique tokens: each prompt, then "
        "its responses, attention per sequence) in the actor update, old log-probs and reference log-probs. "
        "Same numbers, fewer tokens: no (n - 1) prompt copies per group and no padding. null (default): on "
        "when rollout.n > 1, actor.ulysses_sequence_parallel_size is 1 and model.use_remove_padding is off; "
        "false gives verl's padded layout (docs/throughput.md).",
    )
    policy_loss: str = knob(
        "vanilla",
        "Policy loss: PPO clip ('vanilla'), GSPO, or GPG's plain policy gradient ('gpg', no ratio).",
        choices=POLICY_LOSSES,
    )
    clip_ratio_low: float = knob(0.2, "PPO ratio clip below: 1 - clip_ratio_low.", min=0.0)
    clip_ratio_high: float = knob(0.2, "PPO ratio clip above: 1 + clip_ratio_high (clip-higher).", min=0.0)
    clip_ratio_c: float = knob(
        3.0, "Dual-clip bound on the loss of negative-advantage tokens (> 1).", min=1.0
    )
    loss_agg_mode: str = knob(
        "token-mean",
        "How token losses become one number (global over the mini-batch).",
        choices=LOSS_AGG_MODES,
    )
    entropy_coeff: float = knob(0.0, "Entropy bonus weight (subtracted from the loss).")
    use_kl_loss: bool = knob(False, "Add a KL(policy || reference) term to the loss (GRPO style).")
    kl_loss_coef: float = knob(0.001, "Weight of the KL loss term.", min=0.0)
    kl_loss_type: str = knob("low_var_kl", "KL estimator of the loss term.", choices=KL_ESTIMATORS)
    entropy_from_logits_with_chunking: bool = knob(
        False,
        "Compute log-probs and entropy of the actor update and the old-log-prob pass from hidden states and "
        "the LM head weight, entropy_from_logits_chunk_size tokens at a time, never as one [tokens, vocab] "
        "fp32 logits tensor. Same numbers; refused for soft-capped or scaled heads (e.g. Gemma 2).",
    )
    entropy_from_logits_chunk_size: int = knob(
        2048, "Tokens per chunk when entropy_from_logits_with_chunking is on.", unit="tokens", min=1
    )
    entropy_checkpointing: bool = knob(
        False,
        "With entropy_from_logits_with_chunking: recompute each chunk's logits in backward instead of keeping "
        "them for autograd (the update's log-prob/entropy memory no longer grows with the token count).",
    )
    optim: OptimConfig = section(OptimConfig, lr=2e-4, lr_schedule="cosine", min_lr_ratio=0.1)
    fsdp_config: FSDPConfig = section(FSDPConfig)


@dataclass
class RefConfig:
    """The frozen reference policy (built only when a KL term is used)."""

    log_prob_micro_batch_size_per_gpu: int = knob(
        64, "Samples per reference forward pass.", unit="samples per DP rank", min=1
    )
    log_prob_max_token_len_per_gpu: int = knob(
        32768,
        "Token budget of one reference forward pass when ref.log_prob_use_dynamic_bsz is on.",
        unit="tokens per GPU",
        min=1,
    )
    log_prob_use_dynamic_bsz: bool | None = knob(
        None,
        "Form reference micro-batches by token budget (ref.log_prob_max_token_len_per_gpu) instead of count. "
        "null: the same as actor.use_dynamic_bsz.",
    )
    use_prefix_grouper: bool | None = knob(
        None,
        "Run each prompt once for all its samples in a reference micro-batch (see actor.use_prefix_grouper). "
        "null: the same as actor.use_prefix_grouper.",
    )
    ulysses_sequence_parallel_size: int = knob(1, "GPUs sharing each sequence.", unit="GPUs", min=1)
    entropy_from_logits_with_chunking: bool = knob(
        False,
        "Compute the reference log-probs from hidden states and the LM head weight, "
        "entropy_from_logits_chunk_size tokens at a time (no [tokens, vocab] logits tensor). Same numbers.",
    )
    entropy_from_logits_chunk_size: int = knob(
        2048, "Tokens per chunk of the reference pass when chunking is on.", unit="tokens", min=1
    )
    fsdp_config: ShardingConfig = section(ShardingConfig)


@dataclass
class CriticConfig:
    """The value model (built only for estimators that need one, e.g. gae)."""

    model_path: str = knob("", "Critic initialisation; empty: the actor's model.path.")
    ppo_mini_batch_size: int = knob(32, "Prompts per critic optimizer step (global).", unit="prompts", min=1)
    ppo_micro_batch_size_per_gpu: int = knob(
        64, "Samples per critic forward/backward pass.", unit="samples per DP rank", min=1
    )
    forward_micro_batch_size_per_gpu: int = knob(
        64, "Samples per forward-only pass computing values.", unit="samples per DP rank", min=1
    )
    ppo_epochs: int = knob(1, "Critic passes over each step's samples.", unit="epochs", min=1)
    use_dynamic_bsz: bool = knob(False, "Form critic micro-batches by token budget.")
    ppo_max_token_len_per_gpu: int = knob(
        32768, "Token budget of one critic training micro-batch.", unit="tokens per GPU", min=1
    )
    forward_max_token_len_per_gpu: int = knob(
        32768, "Token budget of one value forward pass.", unit="tokens per GPU", min=1
    )
    ulysses_sequence_parallel_size: int = knob(1, "GPUs sharing each sequence.", unit="GPUs", min=1)
    shuffle: bool | None = knob(
        None,
        "Shuffle samples between critic epochs (groups stay whole); null: the same as actor.shuffle.",
    )
    cliprange_value: float = knob(0.5, "Value clipping range around the old values.", min=0.0)
    loss_agg_mode: str = knob("token-mean", "Aggregation of the value loss.", choices=LOSS_AGG_MODES)
    warmup_steps: int = knob(
        0, "Training steps that update only the critic (verl's critic_warmup).", unit="steps", min=0
    )
    use_remove_padding: bool = knob(
        False,
        "Pack the critic's micro-batches (update and values pass) without pads, rows of "
        "critic.remove_padding_max_row_tokens. Same numbers, less compute; needs a verified architecture.",
    )
    remove_padding_max_row_tokens: int | None = knob(
        None,
        "Row length of the critic's packed micro-batches; null: the same as model.remove_padding_max_row_tokens.",
        unit="tokens",
        min=1,
    )
    enable_gradient_checkpointing: bool = knob(
        False,
        "Recompute the critic backbone's decoder-layer activations in backward instead of keeping them.",
    )
    enable_activation_offload: bool = knob(
        False,
        "Move the tensors the critic's training forward saves for backward to pinned CPU memory. CUDA only: "
        "no effect on CPU (a warning says so).",
    )
    optim: OptimConfig = section(OptimConfig, lr=1e-3)
    fsdp_config: FSDPConfig = section(FSDPConfig)
