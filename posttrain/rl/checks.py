"""Every check of an RL run that can be made from the config alone, in one place, before data or weights
load. Each check lives with the component that owns the rule; this module only calls them in order."""

from __future__ import annotations

import torch

from posttrain.config.errors import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.forward.passes import check_plain_lm_head
from posttrain.forward.prefix_grouper import check_prefix_grouper
from posttrain.models.prepare import (
    check_packing,
    check_policy_switches,
    read_model_config,
    warn_offload_on_cpu,
)


def check_rl_switches(cfg: PostTrainConfig, device: torch.device, uses_ref: bool, uses_critic: bool) -> None:
    """Validate every switch of an RL run from configs alone, before data or weights load.

    Raises ValueError naming the key, its value, the rule and the fix.
    """
    a = cfg.actor
    if a.entropy_checkpointing and not a.entropy_from_logits_with_chunking:
        raise ConfigError(
            "actor.entropy_checkpointing=true recomputes the chunked log-prob head's logits in backward, so it "
            "needs actor.entropy_from_logits_with_chunking=true; set both, or drop actor.entropy_checkpointing"
        )
    policy_config = read_model_config(cfg.model.path)
    check_policy_switches(cfg, device, policy_config)
    if a.use_prefix_grouper or (uses_ref and cfg.ref.use_prefix_grouper):
        check_prefix_grouper(cfg, policy_config)
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
