"""Global gradient-norm clipping that also works on FSDP2/TP DTensor gradients."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float | None) -> float:
    """Total L2 norm of all gradients (before clipping), clipping them to `max_norm` if given.

    Sharded gradients give a partial norm per rank; `full_tensor()` reduces it, so every rank
    clips by the same global norm. Parameters without a gradient are skipped.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)
