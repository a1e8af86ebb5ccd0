"""Keeping the rollout engine's copy of the policy current: which engine shares the actor's module (nothing to
push), and what a push is for each backend (full Hugging Face-named weights, LoRA merged, or vLLM's adapter)."""

from __future__ import annotations

from torch import nn

from posttrain.config.schema import PostTrainConfig
from posttrain.models.lora import is_lora_model, policy_weights
from posttrain.rollout.base import RolloutEngine
from posttrain.rollout.native.engine import NativeEngine
from posttrain.rollout.vllm.engine import VLLMEngine
from posttrain.rollout.vllm.lora_sync import AdapterDirs, sync_policy


class RolloutWeights:
    """Pushes the actor's weights into the rollout engine after every update (and once after building or
    resuming). With LoRA on vLLM and ``model.lora_merge=false`` only the adapter travels."""

    def __init__(self, cfg: PostTrainConfig, engine: RolloutEngine):
        self.engine = engine
        self.merge = cfg.model.lora_merge
        self._adapters = AdapterDirs() if isinstance(engine, VLLMEngine) and not self.merge else None

    def shared(self, policy: nn.Module) -> bool:
        """True when the engine decodes with the actor's own module (one process, native engine): no push."""
        return isinstance(self.engine, NativeEngine) and self.engine.model is policy

    def push(self, policy: nn.Module) -> dict[str, float]:
        """Copy ``policy`` into the engine (a collective when the policy is sharded: every rank calls it);
        returns the push's metrics (time, bytes) where the engine reports them."""
        if self.shared(policy):
            return {}
        if isinstance(self.engine, VLLMEngine) and is_lora_model(policy):
            sync_policy(self.engine, policy, self.merge, self._adapters)
        else:
            self.engine.sync_weights(policy_weights(policy))  # Hugging Face names; LoRA adapters merged
        return self.engine.sync_metrics()
