"""Every check of an RL run that can be made from the config alone, in one place, before data or weights
load. Each check lives with the component that owns the rule; this module only calls them in order."""

from __future__ import annotations

import torch

from posttrain.algorithms.rollout_correction import check_rollout_correction
from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.forward.lm_head import check_plain_lm_head
from posttrain.forward.prefix_grouper import check_prefix_grouper
from posttrain.models.prepare import (
    check_packing,
    check_policy_switches,
    read_model_config,
    warn_offload_on_cpu,
)
from posttrain.rollout.vllm.factory import knobs_from_config
from posttrain.rollout.vllm.knobs import check_vllm_settings


def check_rl_switches(cfg: PostTrainConfig, device: torch.device, uses_ref: bool, uses_critic: bool) -> None:
    """Validate every switch of an RL run from configs alone, before data or weights load.

    Raises ValueError naming the key, its value, the rule and the fix.
    """
    a = cfg.actor
    try:  # the algorithms layer raises ValueError (it sits beside config); here it is a user error
        check_rollout_correction(cfg.algorithm.rollout_correction)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if a.entropy_checkpointing and not a.entropy_from_logits_with_chunking:
        raise ConfigError(
            "actor.entropy_checkpointing=true recomputes the chunked log-prob head's logits in backward, so it "
            "needs actor.entropy_from_logits_with_chunking=true; set both, or drop actor.entropy_checkpointing"
        )
    policy_config = read_model_config(cfg.model.path)
    check_policy_switches(cfg, device, policy_config)
    if a.use_prefix_grouper or (uses_ref and cfg.ref.use_prefix_grouper):
        check_prefix_grouper(cfg)
    if policy_config is not None:
        if a.entropy_from_logits_with_chunking:
            check_plain_lm_head(policy_config, "actor.entropy_from_logits_with_chunking")
        if uses_ref and cfg.ref.entropy_from_logits_with_chunking:
            check_plain_lm_head(policy_config, "ref.entropy_from_logits_with_chunking")
    if uses_critic:
        critic_config = read_model_config(cfg.critic.model_path or cfg.model.path)
        if cfg.critic.use_remove_padding and critic_config is not None:
            check_packing("critic.use_remove_padding", critic_config)
        if cfg.critic.enable_activation_offload:
            warn_offload_on_cpu("critic.enable_activation_offload", device)


def check_rollout_backend(cfg: PostTrainConfig, device: torch.device, world_size: int) -> None:
    """`rollout.name=vllm`: vLLM importable (else the install command), its knobs valid for this device and
    world, and bypass mode only where vLLM's log-probs are the trainer's (no top-k/top-p: vLLM renormalises
    after filtering). ConfigError naming the key; nothing loads."""
    r = cfg.rollout
    if r.name != "vllm":
        return
    filtered = r.top_k != -1 or r.top_p < 1.0
    if cfg.algorithm.rollout_correction.bypass_mode and filtered:
        raise ConfigError(
            f"algorithm.rollout_correction.bypass_mode=true uses the rollout's log-probs as the old log-probs, but "
            f"with rollout.top_k={r.top_k} / rollout.top_p={r.top_p} vLLM reports them renormalised after "
            "filtering, not the trainer's log_softmax(logits / temperature); set bypass_mode=false (the actor "
            "recomputes them), or rollout.top_k=-1 and rollout.top_p=1.0"
        )
    lora = cfg.model.lora_rank > 0 or bool(cfg.model.lora_adapter_path)
    if lora and not cfg.model.lora_merge and world_size > 1:
        raise ConfigError(
            f"model.lora_merge=false pushes the LoRA adapter alone into vLLM, which is not supported with "
            f"{world_size} ranks yet (the sharded adapter would have to be gathered before it is saved); set "
            "model.lora_merge=true (merged weights are pushed) or train on one rank"
        )
    knobs = knobs_from_config(
        r,
        cfg.data.max_prompt_length,
        cfg.data.max_response_length,
        cfg.model.lora_rank,
        cfg.model.lora_merge,
        device.type,
    )
    check_vllm_settings(knobs, device.type, cfg.model.dtype, read_model_config(cfg.model.path), world_size)


def check_async_training(cfg: PostTrainConfig, world_size: int) -> None:
    """`async_training.*`: a rollout thread needs one trainer process (beside several ranks it would issue
    collectives concurrently with the trainer's; a Ray-placed worker feeds any number of ranks), a weight push that is a copy of whole tensors (not vLLM's separate LoRA adapter),
    and Ray where it places the worker."""
    a = cfg.async_training
    check_partial_rollout(cfg)
    if not a.enable:
        if a.rollout_worker != "thread":
            raise ConfigError(
                f"async_training.rollout_worker={a.rollout_worker} says where rollouts ahead of training run, "
                "but async_training.enable=false (rollout and training alternate on this process); set "
                "async_training.enable=true"
            )
        return
    if a.rollout_worker == "ray":
        require_ray()
    if world_size > 1 and a.rollout_worker == "thread":
        raise ConfigError(
            f"async_training.enable=true with async_training.rollout_worker=thread needs one trainer process, "
            f"but the world size is {world_size} (a rollout thread beside the ranks would issue collectives "
            "concurrently with the trainer's). Set async_training.rollout_worker=ray (a rollout worker of its "
            "own feeds every rank), or async_training.enable=false"
        )
    lora = cfg.model.lora_rank > 0 or bool(cfg.model.lora_adapter_path)
    if cfg.rollout.name == "vllm" and lora and not cfg.model.lora_merge:
        raise ConfigError(
            "async_training.enable=true pushes weight snapshots taken after each update, but model.lora_merge="
            "false sends vLLM the adapter alone; set model.lora_merge=true (merged weights are pushed)"
        )


def check_partial_rollout(cfg: PostTrainConfig) -> None:
    """`async_training.partial_rollout`: it splits rollouts ahead of training (so needs enable=true), and a
    step's prompts must be known before its responses are finished (so not with DAPO's group filter)."""
    a = cfg.async_training
    if not a.partial_rollout:
        if a.partial_rollout_tokens:
            raise ConfigError(
                f"async_training.partial_rollout_tokens={a.partial_rollout_tokens} says how much of each "
                "response is generated ahead, but async_training.partial_rollout=false (responses are "
                "generated whole); set async_training.partial_rollout=true, or drop partial_rollout_tokens"
            )
        return
    if not a.enable:
        raise ConfigError(
            "async_training.partial_rollout=true splits the rollouts generated ahead of training, but "
            "async_training.enable=false (rollout and training alternate, nothing runs ahead); set "
            "async_training.enable=true"
        )
    if cfg.algorithm.filter_groups.enable:
        raise ConfigError(
            "async_training.partial_rollout=true with algorithm.filter_groups.enable=true: the group filter "
            "scores finished responses to decide whether to draw another generation batch, but a partial "
            "rollout finishes its responses only when the step is about to train. Set "
            "algorithm.filter_groups.enable=false, or async_training.partial_rollout=false"
        )


def require_ray():
    """Ray (an optional extra), or a ConfigError that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            "async_training.rollout_worker=ray places the rollout worker with Ray, which is not installed "
            f"({exc}); pip install 'posttrain[ray]', or set async_training.rollout_worker=thread"
        ) from None
    return ray
