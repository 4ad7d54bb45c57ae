"""The GRPO stage's view of rollout collection: one interface for sync (every rank samples) and async (Ray).

    collection = build_collection(spec, prompts, grpo, run)     # sync or async, by grpo.mode
    with collection:                                            # stops the Ray actors at the end
        batch = collection.next()                               # this rank's groups, stats of the step
        ...train...
        collection.push_weights(model)                          # policy version + 1, to the generators

- `SyncCollection`: each data-parallel rank samples its own prompts with its own generator,
  holding the trainer's current weights (staleness 0).
- `AsyncCollection`: rank 0 drives `grpo.generators` Ray actors over the whole step batch
  (`posttrain.rl.ray_collect`), within `grpo.max_staleness` versions; every rank gets its share.

Both are resumable (`state_dict` / `load_state_dict`: the policy version and the prompt feed
behind the last step trained) and give the held-out evaluation a worker at the trainer's weights.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from posttrain.data.loader import Batches
from posttrain.parallel import broadcast_from_main
from posttrain.rl.collect import PromptFeed, SyncCollector
from posttrain.rl.ray_collect import RayCollector, split_groups, start_ray
from posttrain.rl.rollout import PromptBatch, RolloutGroup, RolloutWorker, WorkerSpec, build_worker, greedy_accuracy, rollout_stats
from posttrain.rl.weights import policy_weights
from posttrain.training.stats import data_parallel_sum

PromptLoader = Callable[[int, int], Batches]  # (rank, world size) -> the prompt batches of that shard


@dataclass
class StepBatch:
    """One step's rollouts as this rank trains them."""

    groups: list[RolloutGroup]  # this rank's share
    stats: dict[str, float]  # over the whole step (all ranks)
    version: int  # policy version they were sampled with
    ticket: int  # the feed's step number of their prompts
    generate_s: float
    wait_s: float  # seconds the trainer waited for them


class _Collection:
    def __init__(self, model: nn.Module, mesh: DeviceMesh | None, device: torch.device):
        self.model, self.mesh, self.device = model, mesh, device
        self.version = 0  # the trainer's policy version: optimizer steps taken
        self.feed: PromptFeed | None = None
        self.ticket = 0
        self.eval_worker: RolloutWorker

    def state_dict(self) -> dict[str, Any]:
        return {"policy_version": self.version, "feed": self.feed.state_after(self.ticket) if self.feed else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after a resumed step: the feed's position, and the generators at the loaded weights."""
        self.version = self.ticket = int(state["policy_version"])
        if self.feed is not None:
            self.feed.load_state_dict(state["feed"])
        self._start_at(self.version)

    def _start_at(self, version: int) -> None:
        raise NotImplementedError

    def ready(self) -> float:
        """Seconds spent waiting for the generators to start (after work that overlaps their start)."""
        return 0.0

    def held_out_accuracy(self, prompts: PromptBatch) -> float:
        """Greedy accuracy at the trainer's current weights, this rank's `prompts` and the others' together."""
        correct, _ = greedy_accuracy(self.eval_worker, prompts)
        correct, total = data_parallel_sum([correct, len(prompts)], self.mesh, self.device)
        return correct / max(total, 1)

    def step_metrics(self) -> dict[str, float]:
        return {}

    def summary(self) -> dict[str, Any]:
        """What the run's summary records about collection (call before the collection closes)."""
        return {}

    def __enter__(self) -> _Collection:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class SyncCollection(_Collection):
    """Every data-parallel rank generates its own share of the step's prompts, with the current weights."""

    def __init__(self, model: nn.Module, spec: WorkerSpec, prompts: PromptLoader, seed: int, mesh: DeviceMesh | None,
                 device: torch.device, rank: int, world_size: int):
        super().__init__(model, mesh, device)
        self.world_size = world_size
        self.feed = PromptFeed(prompts(rank, world_size), seed, rank)
        self.eval_worker = build_worker(spec)
        self.collector = SyncCollector(self.eval_worker, self.feed)

    def _start_at(self, version: int) -> None:
        self.eval_worker.start_at(policy_weights(self.model, every_rank=True), version)

    def next(self) -> StepBatch:
        rollouts, wait_s = self.collector.next(self.version)
        stats = rollout_stats(rollouts.payload)
        summed = data_parallel_sum(list(stats.values()), self.mesh, self.device)
        self.ticket = rollouts.ticket
        return StepBatch(rollouts.payload, dict(zip(stats, (v / self.world_size for v in summed))), rollouts.version,
                         rollouts.ticket, rollouts.generate_s, wait_s)

    def push_weights(self) -> None:
        self.version += 1
        self.collector.push_weights(policy_weights(self.model, every_rank=True), self.version)


class AsyncCollection(_Collection):
    """Rank 0 drives Ray generator actors over the whole step batch; each rank trains its contiguous share."""

    def __init__(self, model: nn.Module, spec: WorkerSpec, prompts: PromptLoader, grpo: Mapping[str, Any], seed: int,
                 mesh: DeviceMesh | None, device: torch.device, rank: int, world_size: int, is_main: bool):
        super().__init__(model, mesh, device)
        self.rank, self.world_size, self.is_main = rank, world_size, is_main
        self.collector: RayCollector | None = None
        if is_main:
            self.feed = PromptFeed(prompts(0, 1), seed)
            threads = int(grpo["generator_threads"])
            ray = start_ray(grpo["ray_address"], num_cpus=max(int(grpo["resources"]["cpus"]), grpo["generators"] * threads))
            actor_spec = dataclasses.replace(spec, device="cuda" if grpo["generator_gpus"] else "cpu")
            self.collector = RayCollector(ray, actor_spec, self.feed, num_generators=int(grpo["generators"]),
                                          max_staleness=int(grpo["max_staleness"]), threads_per_generator=threads,
                                          gpus_per_generator=float(grpo["generator_gpus"]))
        self.eval_worker = build_worker(dataclasses.replace(spec, backend="native"))
        self._started_s = 0.0

    def _start_at(self, version: int) -> None:
        weights = policy_weights(self.model, every_rank=False)
        if self.collector is not None:
            self.collector.start_at(weights, version)

    def ready(self) -> float:
        if self.collector is not None:
            self._started_s = self.collector.wait_ready()
        return self._started_s

    def next(self) -> StepBatch:
        rollouts, wait_s = broadcast_from_main(self.collector.next(self.version) if self.collector else None)
        self.ticket = rollouts.ticket
        return StepBatch(split_groups(rollouts.payload, self.rank, self.world_size), rollout_stats(rollouts.payload),
                         rollouts.version, rollouts.ticket, rollouts.generate_s, wait_s)

    def push_weights(self) -> None:
        self.version += 1
        weights = policy_weights(self.model, every_rank=False)
        if self.collector is not None:
            self.collector.push_weights(weights, self.version)

    def held_out_accuracy(self, prompts: PromptBatch) -> float:
        if self.eval_worker.version != self.version:  # the native eval worker follows the trainer only when asked
            self.eval_worker.start_at(policy_weights(self.model, every_rank=True), self.version)
        return super().held_out_accuracy(prompts)

    def step_metrics(self) -> dict[str, float]:
        return {"dropped_batches": len(self.collector.buffer.dropped)} if self.collector is not None else {}

    def summary(self) -> dict[str, Any]:
        """The generators' start time and the nodes they ran on, next to the trainer's (rank 0's)."""
        nodes = sorted(set(self.collector.nodes())) if self.collector is not None else []
        return {"generator_start_s": self._started_s, "generator_nodes": nodes,
                "trainer_node": os.environ.get("SLURMD_NODENAME") or socket.gethostname()}

    def __exit__(self, *exc: Any) -> None:
        if self.collector is not None:
            try:
                self.collector.close()
            finally:
                self.collector.ray.shutdown()  # stops a local cluster; disconnects from one joined by address


def build_collection(model: nn.Module, spec: WorkerSpec, prompts: PromptLoader, grpo: Mapping[str, Any], seed: int,
                     mesh: DeviceMesh | None, device: torch.device, rank: int, world_size: int,
                     is_main: bool) -> SyncCollection | AsyncCollection:
    """The collection `grpo.mode` asks for (`sync` or `async`)."""
    if grpo["mode"] == "async":
        return AsyncCollection(model, spec, prompts, grpo, seed, mesh, device, rank, world_size, is_main)
    return SyncCollection(model, spec, prompts, seed, mesh, device, rank, world_size)
