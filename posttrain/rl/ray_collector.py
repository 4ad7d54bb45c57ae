"""Async GRPO with Ray: generator actors fill a bounded-staleness buffer while the trainer trains.

    trainer (stage process)                     generator actors (one process each)
      feed -> dispatch work (ticket, prompts) ->  RolloutWorker.collect: sample + score,
      buffer <- StepRollouts(version, groups) <-  tagged with the version they hold
      train step -> version v + 1
      ray.put(weights) -> update_weights(ref, v + 1) -> every actor, checked: exactly one version up

Work goes out only while the buffer (`posttrain.rl.buffer`) has a free slot; its capacity,
`max_staleness + 1` step batches, is how far generation runs ahead of training. A slot freed by
the trainer's take is refilled at its next request, so the trainer's version at the dispatch of
every ticket follows from the sequence of takes and pushes alone, never from timing. An actor
runs its calls one at a time in the order the trainer made them, so work dispatched after the
push of version v is sampled with version v exactly (checked on every batch that arrives):
without dynamic sampling the rollouts trained at step t come from version
max(0, t - 1 - max_staleness). Batches are handed to the trainer in dispatch order
(`StalenessBuffer.take`), and a batch is a pure function of its ticket (prompts and seed from the
feed) and that version's weights.

Resume: `in_flight` lists the tickets dispatched but not yet trained on, each with its version,
and `weights_of` gives those versions' weights (the collector keeps an object-store reference to
every version still referenced by work in flight). A run resumed from them (`start_at` with
`in_flight` and `earlier`) dispatches the same tickets again, each after loading its version,
before it loads the trainer's: it regenerates exactly what the uninterrupted run sampled.

Ray is an optional extra (`pip install posttrain[ray]`). A local cluster binds 127.0.0.1
(`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` is set before ray is imported) and runs without an auth
token; `address` joins an existing cluster instead.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from posttrain.generation.backend import Weights
from posttrain.rl.buffer import StalenessBuffer, StepRollouts
from posttrain.rl.sync_collector import PromptFeed, WorkItem
from posttrain.rl.rollout import PromptBatch, WorkerSpec, build_worker
from posttrain.rl.weights import WeightSyncError

RAY_INSTALL_HINT = "grpo.mode: async needs Ray: `pip install posttrain[ray]` (ray==2.60.0), or set grpo.mode: sync"
# Read by ray at import and start: a local cluster on loopback only, no auth token file.
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


def import_ray(local: bool = True) -> Any:
    """The `ray` module, with the loopback settings of a local cluster applied first; a clear error when missing."""
    if local:
        for key, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(key, value)
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"{RAY_INSTALL_HINT} ({e})") from e
    return ray


def start_ray(address: str | None, num_cpus: int, attempts: int = 3, join_timeout_s: float = 300) -> Any:
    """Join the cluster at `address` (or `RAY_ADDRESS`, which a multi-node job's launcher sets), or start a
    local one with `num_cpus` CPUs; returns the `ray` module.

    A cluster that is still starting (the launcher starts its head beside the trainer) is retried for
    `join_timeout_s`. Ray gives its local node 30 s to start (not configurable); on an overloaded
    machine that can pass, so a local start is tried `attempts` times.
    """
    address = address or os.environ.get("RAY_ADDRESS") or None
    ray = import_ray(local=address is None)
    if ray.is_initialized():
        return ray
    if address is not None:
        deadline = time.monotonic() + join_timeout_s
        while True:
            try:
                ray.init(address=address, include_dashboard=False)
                return ray
            except ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(2)
    for attempt in range(1, attempts + 1):
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False)
            return ray
        except Exception as e:  # ray raises a bare Exception for a node that did not start in time
            if "timed out during startup" not in str(e) or attempt == attempts:
                raise
            ray.shutdown()
            print(f"ray: local node did not start in time (attempt {attempt} of {attempts}); retrying", flush=True)
    return ray


class GeneratorActor:
    """A `RolloutWorker` in its own process (made a Ray actor by `RayCollector`)."""

    def __init__(self, spec: WorkerSpec, threads: int):
        torch.set_num_threads(threads)
        self.worker = build_worker(spec)
        self.applied: list[int] = []  # every version loaded, in order (for checks and logs)

    def start_at(self, weights: Weights, version: int, sent: Mapping[str, int] | None = None) -> int:
        self.applied.append(self.worker.start_at(weights, version, sent))
        return version

    def update_weights(self, weights: Weights, version: int, sent: Mapping[str, int] | None = None) -> int:
        self.applied.append(self.worker.update_weights(weights, version, sent))
        return version

    def collect(self, ticket: int, prompts: PromptBatch, seed: int) -> StepRollouts:
        t0 = time.perf_counter()
        groups = self.worker.collect(prompts, seed)
        return StepRollouts(ticket=ticket, version=self.worker.version, payload=groups,
                            generate_s=time.perf_counter() - t0)

    def versions(self) -> list[int]:
        return list(self.applied)

    def node(self) -> str:
        """Where this actor runs: its Slurm node (inherited from the Ray node started there), else the host."""
        return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class RayCollector:
    """Generator actors, the staleness buffer and in-order weight sync, behind `next` / `push_weights`."""

    def __init__(self, ray: Any, spec: WorkerSpec, feed: PromptFeed, *, num_generators: int, max_staleness: int,
                 threads_per_generator: int = 1, gpus_per_generator: float = 0.0):
        if num_generators < 1:
            raise ValueError(f"grpo.generators must be >= 1, got {num_generators}")
        self.ray, self.feed = ray, feed
        actor_cls = ray.remote(GeneratorActor)
        options = {"num_cpus": threads_per_generator, "num_gpus": gpus_per_generator}
        self.actors = [actor_cls.options(**options).remote(spec, threads_per_generator) for _ in range(num_generators)]
        self.buffer = StalenessBuffer(capacity=max_staleness + 1, max_staleness=max_staleness)
        self.pending: dict[Any, int] = {}  # result ref -> actor index
        self.load = [0] * num_generators  # outstanding work per actor
        self.acks: list[Any] = []  # refs of weight updates not yet confirmed
        self.version = 0  # the last policy version sent to the actors (queued behind earlier work)
        self.dispatched: dict[int, int] = {}  # ticket in flight -> the version it is sampled with
        self.weight_refs: dict[int, Any] = {}  # version -> its weights in the object store, while in use
        self.ready_s: float | None = None  # seconds waited for the actors to be built, once known

    def wait_ready(self) -> float:
        """Block until every actor has built its generator (unless `start_at` did); returns the seconds waited."""
        if self.ready_s is None:
            t0 = time.perf_counter()
            self.ray.get([a.versions.remote() for a in self.actors])
            self.ready_s = time.perf_counter() - t0
        return self.ready_s

    def start_at(self, weights: Weights, version: int, in_flight: Sequence[tuple[int, int]] = (),
                 earlier: Mapping[int, Weights] | None = None, sent: Mapping[str, int] | None = None) -> None:
        """Give every actor the trainer's weights as `version` (a resumed run), before any other work.

        `in_flight`: the (ticket, version) pairs the checkpointed run had dispatched and not trained
        on, in dispatch order, with `earlier` the weights of those versions (version 0, the starting
        policy every actor is built with, needs none). They are dispatched again first, each
        sampled with its own version, as the uninterrupted run did; the feed must stand at the
        first of them.
        """
        self.wait_ready()  # every actor built before the first weights go out (later calls queue behind work)
        earlier = dict(earlier or {})
        for ticket, old in in_flight:
            if old != self.version:
                if old not in earlier:
                    raise ValueError(f"resume state has no weights of policy version {old}, which sampled "
                                     f"ticket {ticket} in flight at the checkpoint")
                self._send_weights(earlier[old], old, first=True)
            item = self.feed.next()
            if item.step != ticket:
                raise ValueError(f"prompt feed resumed at ticket {item.step}, the checkpoint has ticket {ticket} "
                                 "in flight: feed position and in-flight work disagree")
            self._send(item)
        self._send_weights(weights, version, first=True, sent=sent)

    def _send_weights(self, weights: Weights, version: int, first: bool = False,
                      sent: Mapping[str, int] | None = None) -> None:
        """Queue `version` on every actor behind its earlier calls (`first`: a jump, as loaded on resume); with
        `sent` (the trainer's digests), each actor checks it then holds exactly those weights."""
        ref = self.ray.put(weights)
        method = "start_at" if first else "update_weights"
        self.acks += [getattr(a, method).remote(ref, version, sent) for a in self.actors]
        self.version = version
        self.weight_refs[version] = ref
        self._forget_weights()

    def _forget_weights(self) -> None:
        """Drop the references to versions that no work in flight uses and that are not the actors' latest."""
        used = set(self.dispatched.values()) | {self.version}
        for version in [v for v in self.weight_refs if v not in used]:
            del self.weight_refs[version]

    def _send(self, item: WorkItem) -> None:
        """Dispatch one ticket to the least loaded actor, sampled with the version last sent."""
        self.buffer.reserve(item.step)
        self.dispatched[item.step] = self.version
        i = min(range(len(self.actors)), key=lambda a: (self.load[a], a))
        self.pending[self.actors[i].collect.remote(item.step, item.prompts, item.seed)] = i
        self.load[i] += 1

    def _dispatch(self) -> None:
        while self.buffer.free_slots() > 0:
            self._send(self.feed.next())

    def _receive(self, timeout: float | None) -> None:
        if not self.pending:
            return
        # Without waiting: whatever has arrived; otherwise block until one more result is in.
        num_returns = len(self.pending) if timeout == 0 else 1
        ready, _ = self.ray.wait(list(self.pending), num_returns=num_returns, timeout=timeout)
        for ref in ready:
            self.load[self.pending.pop(ref)] -= 1
            item = self.ray.get(ref)
            if item.version != self.dispatched[item.ticket]:
                raise RuntimeError(f"ticket {item.ticket} was sampled with policy version {item.version}, dispatched "
                                   f"after version {self.dispatched[item.ticket]}: weight updates are out of order")
            self.buffer.put(item)

    def in_flight(self) -> list[tuple[int, int]]:
        """(ticket, policy version) of the work dispatched and not yet handed to the trainer, in dispatch order."""
        return [(ticket, self.dispatched[ticket]) for ticket in self.buffer.order]

    def weights_of(self, version: int) -> Weights:
        """The weights sent as `version` (> 0), while work in flight still uses it."""
        return self.ray.get(self.weight_refs[version])

    def _check_acks(self) -> None:
        done, self.acks = self.ray.wait(self.acks, num_returns=len(self.acks), timeout=0) if self.acks else ([], [])
        self._get_acks(done)

    def _get_acks(self, refs: list[Any]) -> None:
        """Re-raise a version an actor refused; a failed weight check as itself (one line, not the actor's trace)."""
        try:
            self.ray.get(refs)
        except self.ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, WeightSyncError):
                raise e.cause from None
            raise

    def next(self, trainer_version: int) -> tuple[StepRollouts, float]:
        """(the next step batch within the staleness bound, seconds the trainer waited for it)."""
        t0 = time.perf_counter()
        while True:
            self._check_acks()
            self._dispatch()
            self._receive(timeout=0)
            item = self.buffer.take(trainer_version)
            self._forget_tickets()
            if item is not None:
                break
            self._dispatch()  # slots freed by dropped batches
            self._receive(timeout=None)
        return item, time.perf_counter() - t0

    def _forget_tickets(self) -> None:
        """Forget the dispatch versions of tickets the buffer no longer holds (taken or dropped)."""
        held = set(self.buffer.order)
        for ticket in [t for t in self.dispatched if t not in held]:
            del self.dispatched[ticket]
        self._forget_weights()

    def push_weights(self, weights: Weights, version: int, sent: Mapping[str, int] | None = None) -> None:
        """Send policy `version` to every actor through the object store (one copy), queued behind earlier work."""
        self._send_weights(weights, version, sent=sent)

    def nodes(self) -> list[str]:
        """The node of each generator actor."""
        return self.ray.get([a.node.remote() for a in self.actors])

    def versions(self) -> list[list[int]]:
        """Per actor, the versions it loaded, in order (waits for queued updates)."""
        return self.ray.get([a.versions.remote() for a in self.actors])

    def close(self) -> None:
        """Confirm the last updates, then stop the actors (work still queued is abandoned)."""
        try:
            self._get_acks(self.acks)
        finally:
            for actor in self.actors:
                self.ray.kill(actor)


def split_groups(groups: Sequence[Any], rank: int, world_size: int) -> list[Any]:
    """This data-parallel rank's contiguous share of a step's rollout groups."""
    if len(groups) % world_size:
        raise ValueError(f"{len(groups)} rollout groups do not split over {world_size} data-parallel ranks")
    per = len(groups) // world_size
    return list(groups[rank * per : (rank + 1) * per])
