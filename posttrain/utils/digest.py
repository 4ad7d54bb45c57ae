"""Exact checksums of tensors' bits, the same on any device: what a generator holds against what a trainer sent."""

from __future__ import annotations

import torch

HeldDigests = dict[str, tuple[torch.dtype, int]]  # tensor name -> (the dtype it is held in, its digest)


def tensor_digest(tensor: torch.Tensor) -> int:
    """Its elements read as integers, each weighed by its position, summed in int64 (wrapping alike everywhere), so a
    changed, moved or missing value shows. -0.0 counts as 0.0 (a kernel read back through the identity returns it so).
    """
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.is_floating_point():
        flat = flat + 0.0
    ints = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]).long()
    weights = torch.arange(ints.numel(), device=ints.device) % 65521 + 1
    return int((ints * weights).sum())
