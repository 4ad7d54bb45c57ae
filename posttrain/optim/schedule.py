"""The learning-rate schedules of every training stage, each after a linear warmup, as a `LambdaLR`
(checkpointable like any scheduler): cosine, linear, constant and warmup-stable-decay."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

SCHEDULES = ("cosine", "linear", "constant", "wsd")


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, schedule: str = "cosine",
              decay_ratio: float = 0.1) -> float:
    """LR multiplier for optimizer step `step` (0-based).

    Warmup rises linearly to 1 over `warmup_steps` steps (step 0 already trains, at 1/warmup). After it,
    over the remaining steps to `total_steps`: `cosine` falls along a half cosine to `min_lr_ratio`;
    `linear` along a straight line; `constant` stays at 1; `wsd` (warmup-stable-decay) stays at 1 until
    the last `decay_ratio` of them, then falls linearly to `min_lr_ratio`. Past `total_steps` it stays
    where it ended.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    if schedule == "constant":
        return 1.0
    if schedule == "wsd":
        stable = 1.0 - decay_ratio
        return 1.0 if progress <= stable else 1.0 - (1.0 - min_lr_ratio) * (progress - stable) / decay_ratio
    raise ValueError(f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")


def build_lr_scheduler(optimizer: Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float,
                       schedule: str = "cosine", decay_ratio: float = 0.1) -> LambdaLR:
    """Call `scheduler.step()` once per optimizer step; drives the in-backward optimizer too."""
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and steps >= 1, got {warmup_steps} and {total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
    return LambdaLR(optimizer, lambda step: lr_factor(step, warmup_steps, total_steps, min_lr_ratio, schedule,
                                                      decay_ratio))
