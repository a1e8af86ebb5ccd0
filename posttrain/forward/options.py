"""Where the throughput and memory switches act: config keys → each pass's forward options (read here) and
module preparation (read in ``posttrain.models.prepare``); docs/throughput.md explains when to use each:

==========================================  ====================================================================
key                                         acts as
==========================================  ====================================================================
model.use_remove_padding,                   ``ForwardOptions.remove_padding`` of the actor, old-log-prob,
model.remove_padding_max_row_tokens         reference and SFT passes (packing in ``posttrain.forward.passes``);
                                            the architecture is checked before any weights load; flash-attention
                                            is loaded on CUDA when ``flash_attn`` is installed (one row per
                                            micro-batch)
critic.use_remove_padding,                  the same for the critic update and the values pass
critic.remove_padding_max_row_tokens
actor.use_prefix_grouper,                   ``ForwardOptions.prefix_grouper`` of the actor update and old-log-prob
ref.use_prefix_grouper                      pass / of the reference pass (``posttrain.forward.prefix_grouper``); the
                                            policy then loads with the shared-prefix attention
                                            (``posttrain.forward.shared_prefix``: sdpa in every other call);
                                            null: on with rollout.n > 1 (``config/load.py``); refused with
                                            Ulysses SP
actor.entropy_from_logits_with_chunking,    ``ForwardOptions.logprob_chunk_size`` / ``chunk_checkpoint`` of the
actor.entropy_from_logits_chunk_size,       actor update and the old-log-prob pass (the chunked head,
actor.entropy_checkpointing                 ``posttrain.forward.chunked_head``)
ref.entropy_from_logits_with_chunking,      the chunked head for the reference pass
ref.entropy_from_logits_chunk_size
model/critic.enable_gradient_checkpointing  Hugging Face ``gradient_checkpointing_enable(use_reentrant=False)``
                                            on the policy (actor, SFT) / the critic backbone
model/critic.enable_activation_offload      ``ForwardOptions.offload_activations`` of the training passes
                                            (``save_on_cpu``, CUDA only; a warning on CPU)
model.use_liger                             liger-kernel's instance patch on the policy and its reference copy
model.lora_rank, model.lora_alpha,          checked in ``posttrain.models.prepare`` with the other policy switches
model.target_modules, model.lora_dropout,   (``posttrain.models.lora.check_lora_config``); applied by
model.lora_adapter_path                     ``posttrain.models.lora.apply_lora`` in the RL and SFT setup
reward.model.use_remove_padding             read by ``posttrain.rl.build.build_reward_model``
distill.teacher.use_remove_padding          ``ForwardOptions.remove_padding`` of the teacher pass; without it the
                                            teacher pass groups prompts when the actor does
distill.teacher.logprob_chunk_size          ``ForwardOptions.logprob_chunk_size`` of the teacher pass (null: the
                                            reference pass's)
==========================================  ====================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.config.schema import PostTrainConfig
from posttrain.config.schema.distill import teacher_head_chunk
from posttrain.forward.packed import preferred_attn_implementation
from posttrain.forward.passes import ForwardOptions
from posttrain.forward.shared_prefix import register_shared_prefix_attention


@dataclass(frozen=True)
class PassOptions:
    """The :class:`ForwardOptions` of every pass of a run, built once from the config."""

    actor: ForwardOptions  # actor update (forward + backward)
    old_log_prob: ForwardOptions  # forward-only, the actor's module
    ref: ForwardOptions  # forward-only, the reference copy
    critic: ForwardOptions  # critic update and the values pass
    sft: ForwardOptions  # SFT (the policy model, like the actor)
    teacher: ForwardOptions = ForwardOptions()  # forward-only, the distillation teacher (distill.teacher)


def _chunk(enabled: bool, size: int) -> int | None:
    return size if enabled else None


def pass_options(cfg: PostTrainConfig, device: torch.device) -> PassOptions:
    """Map the config's switches to each pass's forward options (see the module table)."""
    m, a, r, c = cfg.model, cfg.actor, cfg.ref, cfg.critic
    rows = m.remove_padding_max_row_tokens  # the policy's passes (actor, reference, SFT)
    offload_policy = m.enable_activation_offload and device.type == "cuda"
    offload_critic = c.enable_activation_offload and device.type == "cuda"
    actor_chunk = _chunk(a.entropy_from_logits_with_chunking, a.entropy_from_logits_chunk_size)
    grouped = a.use_prefix_grouper
    return PassOptions(
        actor=ForwardOptions(
            remove_padding=m.use_remove_padding,
            max_row_tokens=rows,
            logprob_chunk_size=actor_chunk,
            chunk_checkpoint=a.entropy_checkpointing,
            offload_activations=offload_policy,
            prefix_grouper=grouped,
        ),
        old_log_prob=ForwardOptions(
            remove_padding=m.use_remove_padding,
            max_row_tokens=rows,
            logprob_chunk_size=actor_chunk,
            prefix_grouper=grouped,
        ),
        ref=ForwardOptions(
            remove_padding=m.use_remove_padding,
            max_row_tokens=rows,
            logprob_chunk_size=_chunk(r.entropy_from_logits_with_chunking, r.entropy_from_logits_chunk_size),
            prefix_grouper=r.use_prefix_grouper,
        ),
        critic=ForwardOptions(
            remove_padding=c.use_remove_padding,
            max_row_tokens=c.remove_padding_max_row_tokens,
            offload_activations=offload_critic,
        ),
        sft=ForwardOptions(
            remove_padding=m.use_remove_padding, max_row_tokens=rows, offload_activations=offload_policy
        ),
        # The old-log-prob pass's layout (the prefix grouper when the actor groups): a teacher equal to the
        # student then gives exactly the student's log-probs.
        teacher=ForwardOptions(
            remove_padding=bool(cfg.distill.teacher.use_remove_padding),
            max_row_tokens=rows,
            prefix_grouper=grouped and not cfg.distill.teacher.use_remove_padding,
            logprob_chunk_size=teacher_head_chunk(cfg.distill.teacher, r),
        ),
    )


def attn_implementation(use_remove_padding: bool, device: torch.device, prefix_grouper: bool = False) -> str:
    """The prefix grouper's shared-prefix attention when its passes group prompts (sdpa in every other call);
    otherwise flash-attention 2 for packed passes on CUDA when ``flash_attn`` is installed (one row per
    micro-batch, varlen kernel), else sdpa (padded batches, packed rows with a block-diagonal mask)."""
    if prefix_grouper:
        return register_shared_prefix_attention()
    return preferred_attn_implementation(device) if use_remove_padding else "sdpa"
