"""Where the trainer gets each step's rollouts: the prompt feed and the in-process (sync) collector.

`PromptFeed` numbers prompt batches by the step they are drawn for and gives each its sampling
seed, so which prompts and which random draws a step sees depends only on the seed and the step
(never on timing), and it remembers the loader position behind every drawn batch so a checkpoint
can record where a resumed run continues. `SyncCollector` generates a step's rollouts when the
trainer asks, with the trainer's current weights (on-policy, staleness 0). The Ray collector
(`posttrain.rl.ray_collector`) offers the same `next` / `push_weights` methods (and `close`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from posttrain.data.loader import Batches
from posttrain.generation.backend import Weights
from posttrain.rl.buffer import StepRollouts
from posttrain.rl.rollout import PromptBatch, RolloutWorker


def rollout_seed(seed: int, step: int, shard: int = 0) -> int:
    """The sampling seed of step `step` on data shard `shard`: distinct per (seed, step, shard)."""
    return int(np.random.SeedSequence([seed, step, shard]).generate_state(1, np.uint64)[0] >> 1)


@dataclass
class WorkItem:
    step: int  # the feed's count of drawn batches: the training step the prompts are drawn for
    prompts: PromptBatch
    seed: int


class PromptFeed:
    """Prompt batches from a loader, numbered 1, 2, ... with a seed each; resumable by loader state."""

    def __init__(self, batches: Batches, seed: int, shard: int = 0, drawn: int = 0):
        self.batches, self.seed, self.shard = batches, seed, shard
        self.drawn = drawn
        self._before: dict[int, dict[str, int]] = {}  # step -> loader state before its batch was drawn

    def next(self) -> WorkItem:
        self.drawn += 1
        self._before[self.drawn] = self.batches.state_dict()
        batch = PromptBatch.from_loader(next(self.batches))
        return WorkItem(self.drawn, batch, rollout_seed(self.seed, self.drawn, self.shard))

    def state_after(self, step: int) -> dict[str, Any]:
        """Feed state once batches up to `step` are consumed: what a run resumed after `step` loads."""
        loader = self._before.get(step + 1)
        if loader is None:
            if step != self.drawn:
                raise ValueError(f"no record of the loader after step {step} (drawn up to {self.drawn})")
            loader = self.batches.state_dict()
        for old in [s for s in self._before if s <= step]:
            del self._before[old]
        return {"loader": loader, "drawn": step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches.load_state_dict(state["loader"])
        self.drawn = int(state["drawn"])
        self._before.clear()


class SyncCollector:
    """Rollouts generated on demand in this process: generate, score, then train, in turn."""

    def __init__(self, worker: RolloutWorker, feed: PromptFeed):
        self.worker, self.feed = worker, feed

    def next(self, trainer_version: int) -> tuple[StepRollouts, float]:
        """(this step's rollouts, seconds the trainer waited for them: all of the generation here)."""
        if self.worker.version != trainer_version:
            raise RuntimeError(f"sync generator holds policy version {self.worker.version}, trainer {trainer_version}")
        t0 = time.perf_counter()
        item = self.feed.next()
        groups = self.worker.collect(item.prompts, item.seed)
        seconds = time.perf_counter() - t0
        return StepRollouts(ticket=item.step, version=self.worker.version, payload=groups, generate_s=seconds), seconds

    def push_weights(self, weights: Weights, version: int, sent: Mapping[str, int] | None = None) -> None:
        self.worker.update_weights(weights, version, sent)
