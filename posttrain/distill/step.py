"""Distillation's step: the KD loss (plus `ce_weight` x cross-entropy) summed over the step's trained tokens."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from posttrain.distill.loss import distill_loss
from posttrain.losses.head import OutputHead
from posttrain.models import Transformer
from posttrain.training.optimization import Optimization
from posttrain.training.token_step import TokenLossStep

PARTS = {"divergence": "kd/divergence", "ce": "kd/ce"}  # record name -> distill_loss's summed metric


def distill_step(student: Transformer, student_head: OutputHead, teacher: Transformer, teacher_head: OutputHead,
                 distill: Mapping[str, Any], ce_weight: float, optimization: Optimization, mesh: DeviceMesh | None,
                 device: torch.device, pad_id: int) -> TokenLossStep:
    """`step(batches)` -> the step's `loss`, `divergence` and `ce` per trained token, `loss_tokens`, `useful_tokens`."""

    def loss_of(batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        return distill_loss(student, student_head, teacher, teacher_head, batch, distill, ce_weight)

    return TokenLossStep(loss_of, optimization, mesh, device, pad_id, parts=PARTS)
