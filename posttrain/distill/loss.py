"""The distillation loss of a batch: student and teacher forwards, then `kd_loss` through both output heads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from posttrain.losses.head import OutputHead, plain
from posttrain.losses.kd import kd_loss
from posttrain.models import Transformer


def distill_loss(
    student: Transformer,
    student_head: OutputHead,
    teacher: Transformer,
    teacher_head: OutputHead,
    batch: Mapping[str, torch.Tensor],
    distill: Mapping[str, Any],
    ce_weight: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The KD loss summed over the batch's trained tokens, and its summed divergence / cross-entropy.

    `ce_weight` mixes in the cross-entropy against the batch's labels; `distill` is the stage's
    section (`loss`, `jsd_beta`, `temperature`). The teacher's forward runs without gradients.
    Neither model's `[batch, seq, vocab]` logits exist unless the heads ask for full logits. Under
    context parallelism both hold this rank's positions, and the sums are made the whole rows'.
    """
    inputs = {"position_ids": batch["position_ids"], "document_ids": batch["document_ids"]}
    student_hidden = plain(student(batch["input_ids"], **inputs))
    with torch.no_grad():
        teacher_hidden = plain(teacher(batch["input_ids"], **inputs))
    loss, metrics = kd_loss(
        student_hidden,
        student_head.rows(),
        teacher_hidden,
        teacher_head.rows(),
        student_head.local(batch["labels"]),
        kind=distill["loss"],
        beta=float(distill["jsd_beta"]),
        temperature=float(distill["temperature"]),
        ce_weight=ce_weight,
        reduction="sum",
        **student_head.chunking(),
    )
    return student_head.whole(loss), {name: student_head.whole(value) for name, value in metrics.items()}
