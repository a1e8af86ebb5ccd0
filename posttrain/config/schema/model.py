"""The policy model and the prompt data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain.config.fields import knob
from posttrain.config.schema.names import DTYPES


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
        "actor update, old log-probs, reference log-probs, SFT and `posttrain rm` training. Same numbers, less compute. Needs an "
        "architecture verified in posttrain/models/registry.py (docs/throughput.md).",
    )
    remove_padding_max_row_tokens: int = knob(
        512,
        "Row length of packed micro-batches with dense attention (sdpa/eager: CPU, or CUDA without "
        "flash-attn), for every packed pass (actor, reference, critic, SFT, `posttrain rm`); raised to the micro-batch's "
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
        "(your GSM8K-format data.train_files: question, answer ending in '#### <number>'; numeric verifier), "
        "or 'reasoning_gym:<name>' (a reasoning-gym task generated from trainer.seed, scored by its own "
        "score_answer; pip install 'posttrain[reasoning-gym]'). Multi-turn tasks (calculator: products of two 2-digit "
        "numbers with a calculator tool; guess_number: a guessing dialogue; python_arithmetic: large products with the sandboxed python "
        "tool) imply rollout.multi_turn.enable=true and play in "
        "their environment unless env.path names another.",
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
    max_response_length: int = knob(
        8,
        "Most tokens generated per response. SFT cuts longer targets (EOS included) to it, with a warning "
        "that counts them and the per-step metric sft/truncated_share.",
        unit="tokens",
        min=1,
    )
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
    task_options: dict[str, Any] = knob(
        default_factory=dict,
        help="Options of the built-in task (data.task_options.NAME=VALUE): for arithmetic min_digits, "
        "max_digits, ops, allow_negative; for calculator min_digits, max_digits (default 2 and 2: 'What is 52 * "
        "67?'); for guess_number low, high, max_turns; for reasoning_gym:<name> the fields of that task's own config "
        "(e.g. data.task_options.max_value=20 for reasoning_gym:gcd). Sizes stay data.num_train_examples "
        "and data.num_val_examples.",
    )
