"""Shared by the method tests: one optimizer step on a loss, and whether it went down."""

from __future__ import annotations

from collections.abc import Callable

import torch


def lowered_by_one_step(parameter: torch.nn.Parameter, loss: Callable[[], torch.Tensor], lr: float = 0.5) -> bool:
    """One SGD step on `loss()`'s gradient; whether `loss()` is lower afterwards."""
    optimizer = torch.optim.SGD([parameter], lr=lr)
    before = loss()
    before.backward()
    optimizer.step()
    return loss().item() < before.item()
