"""Optimizers (AdamW, torchao low-bit, optimizer-in-backward), LR schedule, grad-norm clipping."""

from posttrain.optim.grad_norm import clip_grad_norm_
from posttrain.optim.optimizers import (
    LOW_BIT_OPTIMIZERS,
    OptimizerInBackward,
    build_optimizer,
    check_optimizer_in_backward,
    load_optimizer_state_dict,
    optimizer_state_dict,
)
from posttrain.optim.schedule import SCHEDULES, build_lr_scheduler, lr_factor

__all__ = [
    "LOW_BIT_OPTIMIZERS",
    "OptimizerInBackward",
    "SCHEDULES",
    "build_lr_scheduler",
    "lr_factor",
    "build_optimizer",
    "check_optimizer_in_backward",
    "clip_grad_norm_",
    "load_optimizer_state_dict",
    "optimizer_state_dict",
]
