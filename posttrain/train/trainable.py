"""A trained role's module with its optimizer and learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from posttrain.config.schema import OptimConfig


def lr_lambda(optim: OptimConfig, total_steps: int):
    """Multiplier of the peak lr at optimizer step s: linear warm-up, then constant/cosine/linear decay."""

    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.lr_schedule == "constant":
            return 1.0
        span = max(1, total_steps - optim.warmup_steps)
        progress = min(1.0, (step - optim.warmup_steps) / span)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if optim.lr_schedule == "cosine" else 1 - progress
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * shape

    return factor


@dataclass
class Trainable:
    """A module with its optimizer and schedule (one per trained role)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    grad_clip: float

    @classmethod
    def create(cls, module: nn.Module, optim: OptimConfig, total_optimizer_steps: int) -> Trainable:
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim, total_optimizer_steps))
        return cls(module, optimizer, scheduler, optim.grad_clip)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
