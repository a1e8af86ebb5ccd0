"""Overlong reward shaping (DAPO): a soft penalty for responses that run into the end of the response budget.

With a budget of ``max_response_length`` tokens and a buffer of ``buffer_len`` tokens, a response of ``L`` tokens
(its eos included) gets

    penalty = min(0, -(L - (max_response_length - buffer_len)) / buffer_len * penalty_factor)

added to its reward: 0 up to ``max_response_length - buffer_len`` tokens, then falling linearly to
``-penalty_factor`` at the limit. The penalty depends on lengths only, so every rank computes the same values
from the gathered samples. (verl: ``reward_model.overlong_buffer`` of the DAPO recipe.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OverlongBuffer:
    """The shaping's numbers: the response budget, the width of the penalty zone, the penalty at the limit."""

    max_response_length: int
    buffer_len: int
    penalty_factor: float

    def __post_init__(self) -> None:
        if not 1 <= self.buffer_len <= self.max_response_length:
            raise ValueError(
                f"buffer_len={self.buffer_len} must be in [1, max_response_length={self.max_response_length}]"
            )
        if self.penalty_factor < 0:
            raise ValueError(f"penalty_factor={self.penalty_factor} must be >= 0")

    def penalties(self, lengths: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """[S] float32 penalty (<= 0) of responses of ``lengths`` tokens."""
        lengths = torch.as_tensor(lengths, dtype=torch.float32).reshape(-1)
        exceed = lengths - (self.max_response_length - self.buffer_len)
        return (-exceed / self.buffer_len * self.penalty_factor).clamp(max=0.0)


def overlong_metrics(penalties: torch.Tensor) -> dict[str, float]:
    """The mean penalty and the fraction of responses penalised."""
    if penalties.numel() == 0:
        return {"reward/overlong_penalty_mean": 0.0, "reward/overlong_fraction": 0.0}
    return {
        "reward/overlong_penalty_mean": float(penalties.mean()),
        "reward/overlong_fraction": float((penalties < 0).float().mean()),
    }
