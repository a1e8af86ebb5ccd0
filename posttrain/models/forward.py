"""Forward passes over a RolloutBatch: per-token log-probs/entropy of the responses, and values.

Only the hidden states at response positions go through the LM head, so the logits tensor is
[B, R, V] rather than [B, P+R, V]: prompts can be long and vocabularies large.
"""

from __future__ import annotations

import torch
from torch import nn

from posttrain.algorithms.logprobs import entropy_from_logits, logprobs_from_logits
from posttrain.data.batch import RolloutBatch


def response_hidden_states(model: nn.Module, batch: RolloutBatch) -> torch.Tensor:
    """[B, R, H] hidden states at the positions that predict each response token."""
    decoder = model.get_decoder()
    out = decoder(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,  # a cache object changes how transformers treats masks; never needed here
    )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    p, r = batch.prompt_width, batch.response_width
    return hidden[:, p - 1 : p - 1 + r]


def lm_head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Apply the LM head (and any final logit soft-capping the architecture uses)."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def policy_logprobs(
    model: nn.Module,
    batch: RolloutBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, R] of the response tokens (and entropy [B, R]) under `model` at `temperature`.

    Temperature divides the logits as in the sampler, so old/new log-probs describe the
    distribution the rollout actually sampled from (verl does the same).
    """
    hidden = response_hidden_states(model, batch)
    logits = lm_head_logits(model, hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    b, r, v = logits.shape
    flat = logits.reshape(b * r, v)
    logprobs = logprobs_from_logits(flat, batch.responses.reshape(-1)).view(b, r)
    entropy = entropy_from_logits(flat).view(b, r) if with_entropy else None
    return logprobs, entropy


def critic_values(critic: nn.Module, batch: RolloutBatch) -> torch.Tensor:
    """Values [B, R] at the positions that predict each response token (verl's convention)."""
    values = critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    p, r = batch.prompt_width, batch.response_width
    return values[:, p - 1 : p - 1 + r].float()
