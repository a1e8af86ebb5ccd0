"""The typed container a training step passes between its phases.

Layout (the same as verl's): each row is one sample, `prompt (left-padded to P) + response
(right-padded to R)`, so every response starts at column P and the logits that predict response
token t sit at column P - 1 + t. Phases fill the optional per-token fields in order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

_PER_ROW_FIELDS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "group_ids",
    "old_log_probs",
    "ref_log_probs",
    "teacher_log_probs",
    "values",
    "token_level_scores",
    "token_level_rewards",
    "advantages",
    "returns",
    "reward_baselines",
    "rollout_log_probs",
    "rollout_is_weights",
    "policy_versions",
    "token_versions",
    "teacher_ids",
)


@dataclass
class RolloutBatch:
    """Samples of one step. Shapes: B rows, P prompt columns, R response columns."""

    input_ids: torch.Tensor  # [B, P+R] long
    attention_mask: torch.Tensor  # [B, P+R] long, 1 on real tokens
    position_ids: torch.Tensor  # [B, P+R] long, counts real tokens from 0
    response_mask: torch.Tensor  # [B, R] float, 1 on generated tokens
    group_ids: torch.Tensor  # [B] long, the prompt each sample answers (groups for GRPO and friends)
    prompt_width: int  # P
    old_log_probs: torch.Tensor | None = None  # [B, R]
    ref_log_probs: torch.Tensor | None = None  # [B, R]
    teacher_log_probs: torch.Tensor | None = None  # [B, R], the distillation teacher's (distill.teacher)
    values: torch.Tensor | None = None  # [B, R]
    token_level_scores: torch.Tensor | None = None  # [B, R], the reward on the last response token
    token_level_rewards: torch.Tensor | None = None  # [B, R], scores minus any in-reward KL penalty
    advantages: torch.Tensor | None = None  # [B, R]
    returns: torch.Tensor | None = None  # [B, R]
    reward_baselines: torch.Tensor | None = None  # [B], ReMax's greedy-rollout reward
    rollout_log_probs: torch.Tensor | None = (
        None  # [B, R], the rollout engine's log-prob of each sampled token
    )
    rollout_is_weights: torch.Tensor | None = (
        None  # [B, R], truncated importance weights (rollout correction)
    )
    policy_versions: torch.Tensor | None = None  # [B] long, the update whose weights started each row (async)
    # [B, R] long, the update whose weights sampled each response token, -1 past it (partial rollouts only)
    token_versions: torch.Tensor | None = None
    # [B] long, the distillation teacher of each row by its data_source (distill.teachers), -1: none
    teacher_ids: torch.Tensor | None = None
    # [G] long, sorted: every group of the step on all ranks, when this batch is one rank's share of it
    # (rank-local data, posttrain.parallel.shares); None: the batch is the whole step. Not a per-row field.
    step_groups: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_width(self) -> int:
        return self.response_mask.shape[1]

    @property
    def responses(self) -> torch.Tensor:
        """[B, R] the generated token ids (padding where response_mask is 0)."""
        return self.input_ids[:, self.prompt_width :]

    def seq_lens(self) -> list[int]:
        """Real (prompt + response) tokens per row."""
        return self.attention_mask.sum(-1).tolist()

    def select(self, rows: torch.Tensor | list[int]) -> RolloutBatch:
        """The rows `rows`, in that order (a new batch; tensors are indexed copies)."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        fields = {
            name: (getattr(self, name)[idx] if getattr(self, name) is not None else None)
            for name in _PER_ROW_FIELDS
        }
        return RolloutBatch(prompt_width=self.prompt_width, **fields)

    def trimmed(self) -> RolloutBatch:
        """Drop the columns that are padding in every row (left of the prompts, right of responses).

        Micro-batches carry only their own padding, so short micro-batches compute less.
        """
        real = self.attention_mask.bool()
        prompt_real = real[:, : self.prompt_width].any(0)
        left = int(prompt_real.float().argmax()) if prompt_real.any() else self.prompt_width
        resp_real = self.response_mask.bool().any(0)
        right = int(resp_real.nonzero().max()) + 1 if resp_real.any() else 1
        fields = {}
        for name in _PER_ROW_FIELDS:
            t = getattr(self, name)
            if t is None or t.dim() < 2:
                fields[name] = t
            elif t.shape[1] == self.input_ids.shape[1]:
                fields[name] = t[:, left : self.prompt_width + right]
            else:
                fields[name] = t[:, :right]
        return RolloutBatch(prompt_width=self.prompt_width - left, **fields)

    def to(self, device: torch.device | str) -> RolloutBatch:
        moved = {
            f.name: (v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
            for f in dataclasses.fields(self)
        }
        return RolloutBatch(**moved)


def build_rollout_batch(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    group_ids: list[int],
    pad_token_id: int,
    trainable_mask: list[list[int]] | None = None,
) -> RolloutBatch:
    """Assemble rows `prompt + response` in the left/right padded layout above. ``trainable_mask`` ([B][L_b], 1 on
    tokens the policy sampled) becomes ``response_mask``; None: every response token is trained on."""
    if not prompt_ids or len(prompt_ids) != len(response_ids):
        raise ValueError(f"need as many prompts as responses, got {len(prompt_ids)} and {len(response_ids)}")
    width_p = max(len(p) for p in prompt_ids)
    width_r = max(1, max(len(r) for r in response_ids))
    rows = len(prompt_ids)
    input_ids = torch.full((rows, width_p + width_r), pad_token_id, dtype=torch.long)
    attention = torch.zeros((rows, width_p + width_r), dtype=torch.long)
    response_mask = torch.zeros((rows, width_r), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[i, width_p - len(p) : width_p] = torch.tensor(p, dtype=torch.long)
        attention[i, width_p - len(p) : width_p] = 1
        if r:
            input_ids[i, width_p : width_p + len(r)] = torch.tensor(r, dtype=torch.long)
            attention[i, width_p : width_p + len(r)] = 1
            if trainable_mask is None:
                response_mask[i, : len(r)] = 1.0
            else:
                response_mask[i, : len(r)] = torch.tensor(trainable_mask[i], dtype=torch.float32)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=position_ids,
        response_mask=response_mask,
        group_ids=torch.tensor(group_ids, dtype=torch.long),
        prompt_width=width_p,
    )
