"""Expert parallelism (`parallel.ep`): each rank of an `ep` group holds `num_experts / ep` experts of every
mixture-of-experts layer, and tokens travel to their experts and back by all-to-all.

The layer (`posttrain.models.moe.SparseMoE`) hands its experts one expert-sorted batch of rows with a
count per expert. Hooks on `Experts` turn that into this rank's work: a forward pre-hook sends each
expert's rows to the rank that holds it (the rows of every source rank, regrouped by local expert),
and a forward hook sends the outputs back in the order they came, so routing weights, the sum over
the top-k and the load-balancing loss stay on the token's own rank. Both moves are autograd
all-to-alls: the backward returns each row's gradient to where the row came from.

FSDP2 then shards each layer's held experts over the data-parallel ranks that hold the same experts
(`dp_shard_mod_ep`, with `dp_replicate` under HSDP) and the rest of the model over all of them.
Expert gradients arrive summed over the `ep` group's tokens and FSDP2 averages them over the expert
mesh only, `ep` times fewer ranks than the rest: the experts' weight gradients are scaled by 1 / ep
inside the experts' backward (the rows' own gradients are scaled back), so every gradient is the
data-parallel mean. (FSDP2's `set_gradient_divide_factor` would need PREMUL_SUM, which gloo lacks.)

A layer's experts are numbered as in the checkpoint on every rank; `absent_expert_keys` names the
tensors other ranks hold (a full checkpoint has them), `gather_expert_states` brings them to rank 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from posttrain.models.moe import Experts

EXPERT_DP_DIM = "dp_shard_mod_ep"  # the mesh dimension of the ranks that hold the same experts


def expert_layers(model: nn.Module) -> Iterator[tuple[str, Experts]]:
    """(name in the state dict, experts) of every mixture-of-experts layer."""
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            yield name.replace(_CHECKPOINT_PREFIX, ""), module  # activation checkpointing's wrapper hides itself


class _Dispatch:
    """One forward's all-to-all plan: how many rows go to and come from each rank, and their regrouping."""

    def __init__(self, counts: Tensor, ep: int, group: dist.ProcessGroup):
        local = counts.numel() // ep
        # received[p * local + j]: rows source rank p sends to this rank's j-th expert.
        received = all_to_all_single(counts, [local] * ep, [local] * ep, group).wait()
        self.send = counts.view(ep, local).sum(1).tolist()
        self.recv = received.view(ep, local).sum(1).tolist()
        self.local_counts = received.view(ep, local).sum(0).tolist()
        # Rows arrive by source rank, then expert; the experts want them by expert, then source rank.
        source_expert = torch.arange(ep * local, device=counts.device).repeat_interleave(received)
        self.by_expert = ((source_expert % local) * ep + source_expert // local).argsort(stable=True)
        self.group = group


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` in backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


def _send_to_experts(module: Experts, args: tuple[Tensor, list[int]]) -> tuple[Tensor, list[int]]:
    rows, counts = args
    plan = _Dispatch(torch.tensor(counts, dtype=torch.int64, device=rows.device), module.ep, module.ep_group)
    module._dispatch = plan
    arrived = all_to_all_single_autograd(rows, plan.recv, plan.send, plan.group)
    return _ScaleGrad.apply(arrived[plan.by_expert], float(module.ep)), plan.local_counts


def _return_to_tokens(module: Experts, args: Any, outputs: Tensor) -> Tensor:
    plan: _Dispatch = module._dispatch
    module._dispatch = None
    outputs = _ScaleGrad.apply(outputs, 1.0 / module.ep)  # with the rows' x ep: only the weights' gradients shrink
    arrived_order = torch.empty_like(outputs).index_copy(0, plan.by_expert, outputs)
    return all_to_all_single_autograd(arrived_order, plan.send, plan.recv, plan.group)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Keep this rank's experts of every MoE layer and route tokens to the others' by all-to-all."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    layers = list(expert_layers(model))
    if not layers:
        raise ValueError(f"parallel.ep={ep} shards mixture-of-experts layers, and the model has none: set parallel.ep=1")
    for name, experts in layers:
        total = experts.num_experts
        if total % ep:
            raise ValueError(f"parallel.ep={ep} does not divide the model's num_experts={total} ({name})")
        share = total // ep
        for e in range(total):
            if not rank * share <= e < (rank + 1) * share:
                delattr(experts, str(e))
        experts.ep, experts.ep_group, experts._dispatch = ep, ep_mesh.get_group(), None
        experts.register_forward_pre_hook(_send_to_experts)
        experts.register_forward_hook(_return_to_tokens)


def absent_expert_keys(model: nn.Module) -> set[str]:
    """State-dict keys of the experts other ranks hold (what a full checkpoint has beyond this rank's model)."""
    keys = set()
    for name, experts in expert_layers(model):
        held = experts.held
        template = [key for key in experts.state_dict() if key.startswith(f"{held[0]}.")]
        for e in set(range(experts.num_experts)) - set(held):
            keys.update(f"{name}.{e}.{key.split('.', 1)[1]}" for key in template)
    return keys


def gather_expert_states(model: nn.Module, every_rank: bool = False) -> dict[str, Tensor]:
    """Every layer's experts, full tensors on CPU, on rank 0 (others get `{}`), or on `every_rank`.

    Every rank calls it. Each unshards its held experts over the ranks that share them, then their
    copies are collected (pickled through `gather_object`: simple, and the full state dict is on
    rank 0's CPU anyway when it is written).
    """
    local: dict[str, Tensor] = {}
    for name, experts in expert_layers(model):
        for key, value in experts.state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            local[f"{name}.{key}"] = full.detach().cpu()
    parts: list[Any] = [None] * dist.get_world_size()
    if every_rank:
        dist.all_gather_object(parts, local)
    else:
        dist.gather_object(local, parts if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            return {}
    return {k: v for part in parts for k, v in part.items()}


def uses_expert_parallel(model: nn.Module) -> bool:
    return any(getattr(experts, "ep", 1) > 1 for _, experts in expert_layers(model))
