"""Build a :class:`VLLMEngine` from the trainer's settings (explicit arguments; the trainer calls this)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.rollout.vllm.engine import VLLMEngine
from posttrain.rollout.vllm.knobs import VLLMKnobs
from posttrain.utils.console import warn_once


def knobs_from_config(
    rollout_cfg: Any,
    max_prompt_length: int,
    max_response_length: int,
    lora_rank: int = 0,
    lora_merge: bool = True,
    device: str = "cpu",
) -> VLLMKnobs:
    """``rollout.*`` config values -> :class:`VLLMKnobs`.

    ``rollout.max_model_len=0`` becomes ``max_prompt_length + max_response_length``. ``lora_rank > 0`` without
    ``lora_merge`` turns on vLLM LoRA serving at that rank (adapter-only sync); with ``lora_merge`` merged weights
    are pushed and vLLM runs a plain model. On CPU ``rollout.enable_chunked_prefill`` (true by default, for the
    native engine) is turned off with a warning: vLLM's CPU path crashes with per-request seeds and chunked
    prefill. ``check_vllm_settings`` still refuses it when knobs are built by hand.
    """
    r = rollout_cfg
    max_model_len = r.max_model_len or max_prompt_length + max_response_length
    adapter_only = lora_rank > 0 and not lora_merge
    chunked = bool(r.enable_chunked_prefill)
    if chunked and not str(device).startswith("cuda"):
        warn_once(
            "rollout.enable_chunked_prefill",
            "rollout.enable_chunked_prefill=true is turned off for rollout.name=vllm on CPU: vLLM's CPU path "
            "crashes with per-request seeds and chunked prefill; whole prompts are prefilled in one step, so "
            "rollout.max_num_batched_tokens must be >= the longest prompt + response",
        )
        chunked = False
    return VLLMKnobs(
        gpu_memory_utilization=r.gpu_memory_utilization,
        max_num_seqs=r.max_num_seqs,
        max_num_batched_tokens=r.max_num_batched_tokens,
        max_model_len=max_model_len,
        tensor_model_parallel_size=r.tensor_model_parallel_size,
        enforce_eager=r.enforce_eager,
        enable_chunked_prefill=chunked,
        free_cache_engine=r.free_cache_engine,
        load_format=r.load_format,
        layered_summon=r.layered_summon,
        disable_log_stats=r.disable_log_stats,
        bucket_bytes=r.update_weights_bucket_megabytes << 20,
        enable_lora=adapter_only,
        max_lora_rank=lora_rank if adapter_only else 0,
    )


def build_vllm_engine(
    model_dir: str | Path,
    tokenizer: Any,
    rollout_cfg: Any,
    dtype: str,
    seed: int,
    device: str,
    *,
    max_prompt_length: int,
    max_response_length: int,
    lora_rank: int = 0,
    lora_merge: bool = True,
    eos_token_ids: list[int] | None = None,
) -> VLLMEngine:
    """The engine for ``rollout.name=vllm``.

    model_dir: the policy's Hugging Face directory (what vLLM reads: config, tokenizer, and weights unless
        ``rollout.load_format=dummy``; with dummy the caller must push the full policy before ``generate``).
    tokenizer: gives the default eos id (``[tokenizer.eos_token_id]``, as for the native engine).
    rollout_cfg: the ``rollout`` config section. dtype: ``model.dtype``. seed: ``trainer.seed``.
    device: "cpu" or "cuda" (``trainer.device``). Settings are checked before vLLM loads anything
    (``check_vllm_settings``): a bad one raises ValueError naming its ``rollout.*`` key.
    """
    knobs = knobs_from_config(
        rollout_cfg, max_prompt_length, max_response_length, lora_rank, lora_merge, device
    )
    eos = eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id]
    return VLLMEngine(model_dir, eos, dtype=dtype, seed=seed, device=device, knobs=knobs)
