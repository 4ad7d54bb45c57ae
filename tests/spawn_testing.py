"""Process groups of spawned workers on loopback, for the tests that compare a layout over gloo ranks with one process."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker: Callable[..., None], processes: int, *args: Any) -> None:
    """Run `worker(rank, processes, port, *args)` in `processes` fresh processes; raises if any fails."""
    mp.spawn(worker, args=(processes, free_port(), *args), nprocs=processes, join=True)


def join_loopback_group(rank: int, world_size: int, port: int) -> None:
    """The environment torchrun would give this rank (read by `posttrain.parallel.init_distributed`), one thread."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)


def assert_same_weights(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], label: str,
                        rel: float = 1e-4) -> None:
    """Every tensor of `reference`, and no other, within `rel` relative L2 of it: Adam's normalized step
    turns float noise in tiny gradients into lr-sized element differences, so tensors compare whole."""
    assert set(state) == set(reference), label
    for key, value in reference.items():
        diff = float((state[key] - value).norm() / value.norm())
        assert diff < rel, f"{label}: {key} differs by {diff:.2e} (relative L2)"
