"""The step of the stages whose loss is a sum over tokens (SFT's cross-entropy, distillation's KD loss).

Every trained token of the step weighs the same: each micro-batch's summed loss is divided by
the loss-token count of the whole step (all micro-batches, all ranks), so `grad_accum` and the
process count trade memory and time and leave the gradient alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from posttrain.losses.ce import num_loss_tokens
from posttrain.training.optimization import Optimization
from posttrain.training.stats import data_parallel_sum, local_value, non_pad_tokens

TokenLoss = Callable[[Mapping[str, Tensor]], tuple[Tensor, Mapping[str, Tensor]]]
"""A micro-batch -> its loss summed over its trained tokens, and further sums to report (by name)."""


class TokenLossStep:
    """Forward and backward over a step's micro-batches; returns the loss and `parts` per trained token.

    `parts`: record name -> the `TokenLoss` metric summed alongside (distillation's divergence and
    cross-entropy); `context`: where each loss and its backward run (loss parallel under TP).
    """

    def __init__(self, loss_of: TokenLoss, optimization: Optimization, mesh: DeviceMesh | None, device: torch.device,
                 pad_id: int, parts: Mapping[str, str] | None = None,
                 context: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext):
        self.loss_of, self.optimization, self.mesh, self.device, self.pad_id = loss_of, optimization, mesh, device, pad_id
        self.parts, self.context = dict(parts or {}), context

    def __call__(self, batches: list[Mapping[str, Tensor]]) -> dict[str, float]:
        """`loss`, each part, `loss_tokens` and `useful_tokens` (non-padding, all ranks) of the step."""
        loss_tokens, useful_tokens = data_parallel_sum(
            [sum(num_loss_tokens(b["labels"]) for b in batches),
             sum(non_pad_tokens(b["input_ids"], self.pad_id) for b in batches)],
            self.mesh, self.device,
        )
        sums = dict.fromkeys(("loss", *self.parts), 0.0)
        for batch in batches:
            with self.context():
                loss, parts = self.loss_of(batch)
                self.optimization.backward(loss, per=loss_tokens)
            sums["loss"] += float(local_value(loss.detach()))
            for name, part in self.parts.items():
                sums[name] += float(parts[part])
        totals = data_parallel_sum(list(sums.values()), self.mesh, self.device)
        record = {name: total / max(loss_tokens, 1) for name, total in zip(sums, totals)}
        return {**record, "loss_tokens": int(loss_tokens), "useful_tokens": useful_tokens}
