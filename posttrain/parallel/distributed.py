"""Process-group setup and the device mesh every stage shards its model on.

One code path serves `python stage.py` (one process; on CPU no process group at all) and
`torchrun --nproc-per-node N stage.py` (gloo on CPU, NCCL on CUDA). The mesh has named
dimensions `dp_replicate` x `dp_shard` x `tp`: FSDP2 shards over `dp_shard` (HSDP: replicates
over `dp_replicate`), tensor parallelism splits over `tp`, and ranks of one `tp` group read the
same data. Expert parallelism (`ep` > 1) splits `dp_shard` into `dp_shard_mod_ep` x `ep`, as
torchtitan does: the `ep` ranks hold different experts and read different data, `dp_shard` stays
their flattened product for everything else. Context parallelism (`cp` > 1) adds a `cp` dimension
before `tp`: its ranks read the same batch and hold different positions of it, and FSDP2 shards
over `dp_shard_cp`, `dp_shard` and `cp` flattened.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from posttrain.rules import parallel_layout_problem

T = TypeVar("T")

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes outputs, logs and shows progress bars."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def init_distributed(backend: str | None = None) -> DistInfo:
    """Start the process group when launched by torchrun (or on CUDA) and pick this rank's device.

    Under plain `python` on CPU nothing is initialized (world size 1, no mesh). On CUDA a
    one-process group is created even without torchrun, so FSDP2 mixed precision and the
    sharded code path are the same for one GPU as for many. The default backend is NCCL on
    CUDA and gloo on CPU.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    launched = "RANK" in os.environ and "MASTER_ADDR" in os.environ
    if not dist.is_initialized() and (launched or world_size > 1 or device.type == "cuda"):
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        if launched:
            dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
        else:
            # One process without a launcher: an in-memory store needs no port.
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def build_mesh(info: DistInfo, tp: int = 1, dp_replicate: int = 1, ep: int = 1, cp: int = 1) -> DeviceMesh | None:
    """A 3-D mesh (`dp_replicate`, `dp_shard`, `tp`); None for one process without a process group.

    `dp_shard` takes whatever `tp * cp * dp_replicate` leaves of the world size. With `ep` > 1 the mesh
    is (`dp_replicate`, `dp_shard_mod_ep`, `ep`, `tp`) with `dp_shard` the flattened middle two; with
    `cp` > 1, (`dp_replicate`, `dp_shard`, `cp`, `tp`) with `dp_shard_cp` the flattened middle two.
    """
    problem = parallel_layout_problem(info.world_size, tp, cp, dp_replicate, ep)  # the dry run's rule too
    if problem:
        raise ValueError(problem)
    dp_shard = info.world_size // (tp * cp * dp_replicate)
    if not dist.is_initialized():
        if tp * dp_replicate * ep * cp > 1:
            raise ValueError(
                f"parallel.tp={tp}, parallel.dp_replicate={dp_replicate}, parallel.ep={ep}, parallel.cp={cp} need a "
                "process group: launch with torchrun --nproc-per-node N"
            )
        return None
    if cp > 1:
        mesh = init_device_mesh(info.device.type, (dp_replicate, dp_shard, cp, tp),
                                mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return mesh
    if ep == 1:
        return init_device_mesh(info.device.type, (dp_replicate, dp_shard, tp), mesh_dim_names=MESH_DIMS)
    mesh = init_device_mesh(info.device.type, (dp_replicate, dp_shard // ep, ep, tp),
                            mesh_dim_names=("dp_replicate", "dp_shard_mod_ep", "ep", "tp"))
    mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
    return mesh


def submesh(mesh: DeviceMesh, *dims: str) -> DeviceMesh:
    """`mesh[dims]`, also for the flattened `dp_shard` of an expert-parallel mesh.

    torch 2.13 warns that slicing a flattened dimension from the root will go; until it does, the root
    is the one place every stage finds `dp_shard`, whichever layout built it.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        return mesh[dims[0] if len(dims) == 1 else dims]


def data_parallel_mesh(mesh: DeviceMesh, shard_dim: str | None = None) -> DeviceMesh:
    """What FSDP2 shards over: (`dp_replicate`, `shard_dim`) under HSDP, else `shard_dim` alone.

    `shard_dim` defaults to `dp_shard`, or `dp_shard_cp` under context parallelism.
    """
    shard_dim = shard_dim or ("dp_shard_cp" if mesh_size(mesh, "cp") > 1 else "dp_shard")
    return submesh(mesh, *(("dp_replicate", shard_dim) if mesh_size(mesh, "dp_replicate") > 1 else (shard_dim,)))


def mesh_size(mesh: DeviceMesh | None, dim: str) -> int:
    """The size of `dim` (1 without a mesh, or for `ep` / `cp` on a mesh without them)."""
    if mesh is None or (dim in ("ep", "cp") and dim not in (mesh.mesh_dim_names or ())):
        return 1
    return submesh(mesh, dim).size()


def data_parallel_rank(mesh: DeviceMesh | None) -> tuple[int, int]:
    """(rank, size) of this process among the data-parallel replicas: what the data loader shards by.

    Tensor-parallel peers get the same rank, so they read the same batch.
    """
    if mesh is None:
        return 0, 1
    rep, shard = submesh(mesh, "dp_replicate"), submesh(mesh, "dp_shard")
    return rep.get_local_rank() * shard.size() + shard.get_local_rank(), rep.size() * shard.size()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def on_main(fn: Callable[[], T], info: DistInfo) -> T | None:
    """Run `fn` on rank 0 only (writing files, downloads), then let every rank continue together."""
    result = fn() if info.is_main else None
    barrier()
    return result


def broadcast_from_main(value: T) -> T:
    """Rank 0's `value` (any picklable object) on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_mean(value: float | torch.Tensor, device: torch.device | None = None) -> float:
    """Average of a scalar over all ranks (losses and token counts for logging).

    A DTensor (the loss under `loss_parallel`) is reduced over its own mesh first.
    """
    if isinstance(value, DTensor):
        value = value.full_tensor()
    tensor = torch.as_tensor(value, dtype=torch.float64, device=device).detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)  # gloo has no AVG
        tensor /= dist.get_world_size()
    return float(tensor)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
