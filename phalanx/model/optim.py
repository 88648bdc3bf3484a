"""AdamW with decoupled weight decay on matrices only, and a warm-up + cosine schedule in steps."""
from __future__ import annotations

import math

import torch
from torch import nn

from phalanx.core.config import TrainConfig


def build_optimizer(model: nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2))


class WarmupCosine:
    """Learning rate as a pure function of the optimizer step: linear warm-up, then cosine decay.

    Being a function of the step, its whole state is the step, so resume is exact by construction.
    """

    def __init__(self, t: TrainConfig):
        self.peak, self.floor = t.lr, t.lr * t.min_lr_ratio
        self.warmup, self.total = t.warmup_steps, t.max_steps
        self.step = 0

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.floor + 0.5 * (self.peak - self.floor) * (1 + math.cos(math.pi * progress))

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        self.step = step
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
