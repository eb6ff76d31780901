"""The learning-rate schedule: linear warmup, then cosine decay to ``min_lr_ratio``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import TrainConfig


def lr_lambda(cfg: TrainConfig):
    warmup = cfg.warmup_steps if cfg.warmup_steps >= 0 else max(1, cfg.steps // 10)
    total = max(cfg.steps, warmup + 1)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
