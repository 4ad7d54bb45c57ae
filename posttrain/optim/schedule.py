"""Linear warmup then cosine decay to a floor, as a `LambdaLR` (checkpointable like any scheduler)."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier for optimizer step `step` (0-based).

    Warmup rises linearly to 1 over `warmup_steps` steps (step 0 already trains, at 1/warmup);
    then a half cosine falls from 1 to `min_lr_ratio` at `total_steps` and stays there.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> LambdaLR:
    """Call `scheduler.step()` once per optimizer step; drives the in-backward optimizer too."""
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and steps >= 1, got {warmup_steps} and {total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    return LambdaLR(optimizer, lambda step: warmup_cosine_factor(step, warmup_steps, total_steps, min_lr_ratio))
