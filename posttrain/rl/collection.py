"""The GRPO stage's view of rollout collection: one interface for sync (every rank samples) and async (Ray).

    collection = build_collection(model, spec, prompts, grpo, seed, mesh, device, rank, world_size, is_main)
    run.resume(model, optimization, collection)                 # the feed, the version, the work in flight
    with collection:                                            # stops the Ray actors at the end
        collection.ready()                                      # generators built (async)
        batch = collection.next()                               # this rank's groups, stats of the step
        ...train the model on it...
        collection.push_weights()                               # the model's weights as the next policy version

- `SyncCollection`: each data-parallel rank samples its own prompts with its own generator,
  holding the trainer's current weights (staleness 0).
- `AsyncCollection`: rank 0 drives `grpo.generators` Ray actors over the whole step batch
  (`posttrain.rl.ray_collector`), within `grpo.max_staleness` versions; every rank gets its share.

Both are resumable (`state_dict` / `load_state_dict`: the policy version and the prompt feed
behind the last step trained) and give the held-out evaluation a worker at the trainer's weights.
The async one also keeps the work it had in flight: each ticket dispatched and not yet trained on
with the policy version sampling it, and (`save_files` / `load_files`, in the checkpoint
directory) the weights of those versions, so a resumed run samples exactly those tickets again
with exactly those weights before it goes on (`RayCollector.start_at`).

DAPO's dynamic sampling (`grpo.dynamic_sampling`) is theirs alike: a group whose rewards are all
equal has no advantage to learn from, so it is dropped and the step drawn up again from the next
prompt batches, at most `grpo.max_resamples` extra batches a step (every rank draws as often);
a step still short after that is filled with dropped groups, which train nothing, so every step
keeps its size. The step's statistics cover every group sampled.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from posttrain.data.loader import Batches
from posttrain.evaluation.greedy import greedy_accuracy
from posttrain.parallel import broadcast_from_main
from posttrain.rl.sync_collector import PromptFeed, SyncCollector
from posttrain.rl.ray_collector import RayCollector, split_groups, start_ray
from posttrain.rl.rollout import PromptBatch, RolloutGroup, RolloutWorker, WorkerSpec, build_worker, rollout_stats
from posttrain.rl.weights import corrupted_for_test, policy_weights, weights_digest
from posttrain.training.stats import data_parallel_sum, max_over_ranks

PromptLoader = Callable[[int, int], Batches]  # (rank, world size) -> the prompt batches of that shard
GENERATOR_WEIGHTS = "generator-weights"  # checkpoint subfolder: weights of the versions sampling work in flight


def _weights_file(directory: Path, version: int) -> Path:
    return directory / GENERATOR_WEIGHTS / f"version-{version:08d}.pt"


@dataclass
class StepBatch:
    """One step's rollouts as this rank trains them."""

    groups: list[RolloutGroup]  # this rank's share
    stats: dict[str, float]  # over the whole step (all ranks)
    version: int  # policy version they were sampled with
    ticket: int  # the feed's step number of their prompts
    generate_s: float
    wait_s: float  # seconds the trainer waited for them


def informative(group: RolloutGroup) -> bool:
    """Whether the group's rewards differ, so its advantages are not all zero."""
    return len(set(group.rewards)) > 1


@dataclass
class _Draw:
    """Rollouts of one or more prompt batches of a step, before they are shared out."""

    groups: list[RolloutGroup]  # what the step trains on
    sampled: list[RolloutGroup]  # every group drawn for it (its statistics)
    version: int  # the oldest policy version among them
    ticket: int  # the feed's number of the last prompt batch drawn
    generate_s: float
    wait_s: float


class _Collection:
    def __init__(self, model: nn.Module, mesh: DeviceMesh | None, device: torch.device, grpo: Mapping[str, Any]):
        self.model, self.mesh, self.device, self.grpo = model, mesh, device, grpo
        self.version = 0  # the trainer's policy version: optimizer steps taken
        self.feed: PromptFeed | None = None
        self.ticket = 0
        self.eval_worker: RolloutWorker
        self.resamples = int(grpo["max_resamples"]) if grpo["dynamic_sampling"] else None
        self.resampled = 0  # extra prompt batches the last step drew

    def next(self) -> StepBatch:
        """This rank's groups of the next step (drawn up again without flat groups under dynamic sampling)."""
        draw = self._draw()
        if self.resamples is not None:
            draw = self._without_flat_groups(draw)
        self.ticket = draw.ticket
        return StepBatch(self._share(draw.groups), self._stats(draw.sampled), draw.version, draw.ticket,
                         draw.generate_s, draw.wait_s)

    def _without_flat_groups(self, first: _Draw) -> _Draw:
        size, draws, kept = len(first.groups), [first], [g for g in first.groups if informative(g)]
        while len(draws) <= self.resamples and max_over_ranks(float(len(kept) < size), self.device):
            draws.append(self._draw())
            kept += [g for g in draws[-1].groups if informative(g)]
        self.resampled = len(draws) - 1
        sampled = [g for d in draws for g in d.groups]
        flat = [g for g in sampled if not informative(g)]
        return _Draw((kept + flat)[:size], sampled, min(d.version for d in draws), draws[-1].ticket,
                     sum(d.generate_s for d in draws), sum(d.wait_s for d in draws))

    def _sent(self, weights: Mapping[str, torch.Tensor]) -> dict[str, int] | None:
        """The digests a push carries (`grpo.verify_weights`): the generator checks it then samples with exactly
        these weights (`posttrain.rl.weights.verify_push`)."""
        return weights_digest(weights) if self.grpo["verify_weights"] else None

    def _draw(self) -> _Draw:
        """The rollouts of the next prompt batch (this rank's in sync mode, the whole step's in async)."""
        raise NotImplementedError

    def _share(self, groups: list[RolloutGroup]) -> list[RolloutGroup]:
        """This rank's part of a draw's groups."""
        raise NotImplementedError

    def _stats(self, groups: list[RolloutGroup]) -> dict[str, float]:
        """`rollout_stats` over the whole step (every rank's groups)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"policy_version": self.version, "feed": self.feed.state_after(self.ticket) if self.feed else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after a resumed step: the feed's position, and the generators at the loaded weights."""
        self.version = int(state["policy_version"])
        if self.feed is not None:
            self.feed.load_state_dict(state["feed"])
        self.ticket = self.feed.drawn if self.feed is not None else self.version  # resampling draws ahead of steps
        self._start_at(self.version)

    def _start_at(self, version: int) -> None:
        raise NotImplementedError

    def ready(self) -> float:
        """Seconds spent waiting for the generators to start (after work that overlaps their start)."""
        return 0.0

    def held_out_accuracy(self, prompts: PromptBatch) -> float:
        """Greedy accuracy at the trainer's current weights (greedy episodes with an environment), this rank's
        `prompts` and the others' together."""
        worker = self.eval_worker
        return greedy_accuracy(worker.sampler, prompts.prompt_ids, prompts.examples, worker.reward_fn.correct,
                               worker.params.max_new_tokens, self.mesh, self.device)

    def step_metrics(self) -> dict[str, float]:
        return {} if self.resamples is None else {"resampled_batches": self.resampled}

    def summary(self) -> dict[str, Any]:
        """What the run's summary records about collection (call before the collection closes)."""
        return {}

    def __enter__(self) -> _Collection:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class SyncCollection(_Collection):
    """Every data-parallel rank generates its own share of the step's prompts, with the current weights."""

    def __init__(self, model: nn.Module, spec: WorkerSpec, prompts: PromptLoader, grpo: Mapping[str, Any], seed: int,
                 mesh: DeviceMesh | None, device: torch.device, rank: int, world_size: int):
        super().__init__(model, mesh, device, grpo)
        self.world_size = world_size
        self.feed = PromptFeed(prompts(rank, world_size), seed, rank)
        self.eval_worker = build_worker(spec)
        self.collector = SyncCollector(self.eval_worker, self.feed)

    def _start_at(self, version: int) -> None:
        weights = policy_weights(self.model, every_rank=True)
        self.eval_worker.start_at(weights, version, self._sent(weights))

    def _draw(self) -> _Draw:
        rollouts, wait_s = self.collector.next(self.version)
        return _Draw(rollouts.payload, rollouts.payload, rollouts.version, rollouts.ticket, rollouts.generate_s, wait_s)

    def _share(self, groups: list[RolloutGroup]) -> list[RolloutGroup]:
        return groups

    def _stats(self, groups: list[RolloutGroup]) -> dict[str, float]:
        stats = rollout_stats(groups)
        summed = data_parallel_sum(list(stats.values()), self.mesh, self.device)
        return dict(zip(stats, (v / self.world_size for v in summed)))

    def push_weights(self) -> None:
        self.version += 1
        weights = policy_weights(self.model, every_rank=True)
        self.collector.push_weights(corrupted_for_test(weights, self.version), self.version, self._sent(weights))


class AsyncCollection(_Collection):
    """Rank 0 drives Ray generator actors over the whole step batch; each rank trains its contiguous share."""

    def __init__(self, model: nn.Module, spec: WorkerSpec, prompts: PromptLoader, grpo: Mapping[str, Any], seed: int,
                 mesh: DeviceMesh | None, device: torch.device, rank: int, world_size: int, is_main: bool):
        super().__init__(model, mesh, device, grpo)
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
        self._in_flight: list[tuple[int, int]] = []  # resume: (ticket, version) to sample again, and
        self._earlier: dict[int, dict[str, torch.Tensor]] = {}  # the weights of those versions

    def state_dict(self) -> dict[str, Any]:
        if self.collector is None:
            return super().state_dict()
        return {**super().state_dict(), "in_flight": self.collector.in_flight(),
                "dropped": [list(d) for d in self.collector.buffer.dropped]}

    def save_files(self, directory: Path) -> None:
        """The weights of every policy version (> 0) that samples work in flight, into `directory` (rank 0)."""
        if self.collector is None:
            return
        versions = sorted({v for _, v in self.collector.in_flight() if v > 0})
        if versions:
            (directory / GENERATOR_WEIGHTS).mkdir()
        for version in versions:
            torch.save(dict(self.collector.weights_of(version)), _weights_file(directory, version))

    def load_files(self, directory: Path) -> None:
        """The weights `save_files` left in `directory`, for the tickets a resumed run samples again."""
        if self.collector is None:
            return
        for path in sorted((directory / GENERATOR_WEIGHTS).glob("version-*.pt")):
            self._earlier[int(path.stem.split("-")[1])] = torch.load(path, map_location="cpu", weights_only=True)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.collector is not None:
            self._in_flight = [(int(t), int(v)) for t, v in state["in_flight"]]
            self.collector.buffer.dropped = [(int(t), int(v)) for t, v in state["dropped"]]
        super().load_state_dict(state)

    def _start_at(self, version: int) -> None:
        weights = policy_weights(self.model, every_rank=False)
        if self.collector is not None:
            # the feed stands at the first ticket in flight: those go out again before the trainer's version
            self.collector.start_at(weights, version, self._in_flight, self._earlier, self._sent(weights))
            self._in_flight, self._earlier = [], {}

    def ready(self) -> float:
        if self.collector is not None:
            self._started_s = self.collector.wait_ready()
        return self._started_s

    def _draw(self) -> _Draw:
        rollouts, wait_s = broadcast_from_main(self.collector.next(self.version) if self.collector else None)
        return _Draw(rollouts.payload, rollouts.payload, rollouts.version, rollouts.ticket, rollouts.generate_s, wait_s)

    def _share(self, groups: list[RolloutGroup]) -> list[RolloutGroup]:
        return split_groups(groups, self.rank, self.world_size)

    def _stats(self, groups: list[RolloutGroup]) -> dict[str, float]:
        return rollout_stats(groups)  # every rank holds the whole step's groups

    def push_weights(self) -> None:
        self.version += 1
        weights = policy_weights(self.model, every_rank=False)
        if self.collector is not None:
            self.collector.push_weights(corrupted_for_test(weights, self.version), self.version, self._sent(weights))

    def held_out_accuracy(self, prompts: PromptBatch) -> float:
        if self.eval_worker.version != self.version:  # the native eval worker follows the trainer only when asked
            self.eval_worker.start_at(policy_weights(self.model, every_rank=True), self.version)
        return super().held_out_accuracy(prompts)

    def step_metrics(self) -> dict[str, float]:
        dropped = {"dropped_batches": len(self.collector.buffer.dropped)} if self.collector is not None else {}
        return {**super().step_metrics(), **dropped}

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
    return SyncCollection(model, spec, prompts, grpo, seed, mesh, device, rank, world_size)
