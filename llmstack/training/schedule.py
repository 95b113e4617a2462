"""Learning-rate schedule: linear warmup from 0 to `lr`, then cosine decay to `min_lr` at `max_steps`."""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: Optimizer, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> LambdaLR:
    """A LambdaLR that DeepSpeed steps once per optimizer step (and saves in its checkpoints)."""
    return LambdaLR(optimizer, lambda step: lr_at(step, lr, min_lr, warmup_steps, max_steps) / lr)
