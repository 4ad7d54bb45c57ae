"""Evaluation during training: which held-out evaluation is the best so far, and when to stop early.

A stage's section sets `eval_every` (steps between evaluations; 0: before and after training only),
`keep` (`last`, or `best`: the output is the weights of the best evaluation), `metric` (what `best`
and early stopping compare; null: the stage's first in `rules.HELD_OUT_METRICS`) and
`early_stopping: {patience, min_delta}` (stop once `patience` evaluations in a row have not beaten
the best by more than `min_delta`; patience 0: never). An evaluation improves on the best when it is
better by more than `min_delta`, so `best` and early stopping agree on what counts. Everything here is
a function of the logged values, and its state rides in the checkpoints, so a resumed run selects and
stops where the uninterrupted one does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from posttrain.rules import held_out_metric


@dataclass
class Selection:
    """The best evaluation so far and the evaluations since it (a checkpoint's `selection` entry)."""

    metric: str
    goal: str  # "min" or "max"
    min_delta: float = 0.0
    patience: int = 0
    best: float | None = None
    best_step: int | None = None
    since_best: int = 0

    @classmethod
    def of(cls, stage: str, section: Mapping[str, Any]) -> Selection:
        metric, goal = held_out_metric(stage, section.get("metric"))
        stopping = section.get("early_stopping") or {}
        return cls(metric, goal, float(stopping.get("min_delta", 0.0)), int(stopping.get("patience", 0)))

    def update(self, step: int, values: Mapping[str, float]) -> bool:
        """Record the evaluation at `step`; True when it is the new best."""
        if self.metric not in values:
            raise KeyError(f"the evaluation returned {sorted(values)}, not the selection metric {self.metric!r}")
        value = float(values[self.metric])
        if math.isnan(value):
            improved = False
        elif self.best is None:
            improved = True
        else:
            gain = value - self.best if self.goal == "max" else self.best - value
            improved = gain > self.min_delta
        if improved:
            self.best, self.best_step, self.since_best = value, step, 0
        else:
            self.since_best += 1
        return improved

    def should_stop(self) -> bool:
        return self.patience > 0 and self.since_best >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best, self.best_step, self.since_best = state["best"], state["best_step"], state["since_best"]

    def summary(self) -> dict[str, Any]:
        return {"selection_metric": self.metric, "best_step": self.best_step, f"best_{self.metric}": self.best}
