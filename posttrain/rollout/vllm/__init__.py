"""vLLM rollout backend (``rollout.name=vllm``): the same ``RolloutEngine`` protocol as the native engine, backed
by an in-process ``vllm.LLM``. Importing this package does not import vllm; building an engine does (and raises
a ValueError with the install command when it is missing)."""

from posttrain.rollout.vllm.engine import VLLMEngine, logprobs_match_trainer, sample_seed, turn_seed
from posttrain.rollout.vllm.factory import build_vllm_engine, knobs_from_config
from posttrain.rollout.vllm.knobs import VLLMKnobs, check_vllm_settings, cpu_kv_cache_bytes, require_vllm
from posttrain.rollout.vllm.weight_sync import plan_buckets

__all__ = [
    "VLLMEngine",
    "VLLMKnobs",
    "build_vllm_engine",
    "check_vllm_settings",
    "cpu_kv_cache_bytes",
    "knobs_from_config",
    "logprobs_match_trainer",
    "plan_buckets",
    "require_vllm",
    "sample_seed",
    "turn_seed",
]
