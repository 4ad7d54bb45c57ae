"""Distributed setup, device meshes, and `parallelize` (TP, activation checkpointing, compile, FSDP2)."""

from posttrain.parallel.distributed import (
    DistInfo,
    all_reduce_mean,
    barrier,
    broadcast_from_main,
    build_mesh,
    data_parallel_rank,
    destroy,
    init_distributed,
    mesh_size,
    on_main,
)
from posttrain.parallel.parallelize import (
    gather_full_state_dict,
    load_full_state_dict,
    loss_context,
    materialize,
    parallelize,
    uses_tensor_parallel,
)

__all__ = [
    "DistInfo",
    "all_reduce_mean",
    "barrier",
    "broadcast_from_main",
    "build_mesh",
    "data_parallel_rank",
    "destroy",
    "gather_full_state_dict",
    "init_distributed",
    "load_full_state_dict",
    "loss_context",
    "materialize",
    "mesh_size",
    "on_main",
    "parallelize",
    "uses_tensor_parallel",
]
