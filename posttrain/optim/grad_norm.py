"""Global gradient-norm clipping that also works on FSDP2/TP DTensor gradients."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from posttrain.parallel.expert_parallel import EXPERT_DP_DIM


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float | None) -> float:
    """Total L2 norm of all gradients (before clipping), clipping them to `max_norm` if given.

    Sharded gradients give a partial norm per rank; `full_tensor()` reduces it over their mesh, so every
    rank clips by the same global norm. Gradients on several meshes (expert parallelism: the experts on
    the ranks holding the same ones) are normed per mesh and combined. Parameters without a gradient
    are skipped.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    by_mesh: dict[object, list[nn.Parameter]] = {}
    for p in params:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = [_mesh_norm(mesh, grads) for mesh, grads in by_mesh.items()]
    total = norms[0] if len(norms) == 1 else torch.stack([n.float() ** 2 for n in norms]).sum().sqrt()
    if max_norm is not None:
        for group in by_mesh.values():  # DTensor ops take one mesh at a time
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return float(total)


def _mesh_norm(mesh: object, params: list[nn.Parameter]) -> Tensor:
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if mesh is not None and EXPERT_DP_DIM in (mesh.mesh_dim_names or ()):
        # Each expert-parallel rank holds other experts: sum their squares over every rank, where each
        # rank's expert set appears once per rank of its mesh (the ranks that share it; TP refuses MoE).
        square = norm.float() ** 2
        dist.all_reduce(square)
        norm = (square / mesh.size()).sqrt()
    return norm
