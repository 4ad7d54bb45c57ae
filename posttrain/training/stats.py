"""Step statistics summed over data-parallel replicas (token counts, loss sums)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from posttrain.parallel import mesh_size


def local_value(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor (a replicated DTensor, as loss-parallel losses are, becomes its full value)."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def data_parallel_sum(values: Sequence[float | torch.Tensor], mesh: DeviceMesh | None, device: torch.device) -> list[float]:
    """Sum each value over the data-parallel replicas, in one float64 all-reduce.

    Tensor- and context-parallel peers hold identical values (same batch; the losses of context
    parallelism are whole-row), so the world sum is divided by their degrees.
    """
    t = torch.tensor([float(local_value(v)) if isinstance(v, torch.Tensor) else float(v) for v in values],
                     dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
        t /= mesh_size(mesh, "tp") * mesh_size(mesh, "cp")
    return t.tolist()


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest of each rank's `value`."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def non_pad_tokens(input_ids: torch.Tensor, pad_id: int) -> int:
    """Tokens that carry data (what throughput counts)."""
    return int((input_ids != pad_id).sum())
