"""Knowledge-distillation divergences between teacher and student, chunk by chunk over tokens.

Neither model's ``[B, S, V]`` logits exist in full: the function takes both models' final hidden
states and output projections, keeps the positions with ``labels != -100`` (aligned labels, see
``posttrain.losses.logprobs``), and per chunk projects both, computes the divergence in float32
and (under checkpointing) discards the chunk. The teacher's hidden states come from a
``torch.no_grad`` forward by the caller; its projection is recomputed in the backward pass of
each checkpointed chunk rather than stored.

Divergences, with P the teacher's and Q the student's token distribution at temperature T:
  * ``forward_kl``: KL(P || Q), mode-covering (classic KD);
  * ``reverse_kl``: KL(Q || P), mode-seeking (MiniLLM);
  * ``jsd``: generalized Jensen-Shannon of GKD (Agarwal et al. 2024),
    ``beta KL(P || M) + (1 - beta) KL(Q || M)`` with ``M = beta P + (1 - beta) Q``, 0 < beta < 1.
The divergence is multiplied by T^2 (Hinton et al.) so its gradient scale does not shrink with
the temperature relative to the cross-entropy it is mixed with.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.losses.ce import Reduction
from posttrain.losses.chunked import IGNORE_INDEX, Project, gather_rows, kept_indices, logits_width, map_row_chunks

Divergence = Literal["forward_kl", "reverse_kl", "jsd"]


def token_divergence(
    student_logits: Tensor,
    teacher_logits: Tensor,
    kind: Divergence,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> Tensor:
    """Per-row divergence ``[N]`` (float32, times T^2) between ``[N, V]`` logits of both models."""
    if kind not in ("forward_kl", "reverse_kl", "jsd"):
        raise ValueError(f"distill.loss must be one of forward_kl, reverse_kl, jsd; got {kind!r}")
    student_logp = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher_logp = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if kind == "forward_kl":
        div = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
    elif kind == "reverse_kl":
        div = (student_logp.exp() * (student_logp - teacher_logp)).sum(-1)
    else:
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd needs 0 < beta < 1, got {beta} (use forward_kl / reverse_kl for the limits)")
        mixture_logp = torch.logaddexp(teacher_logp + math.log(beta), student_logp + math.log(1 - beta))
        div = beta * (teacher_logp.exp() * (teacher_logp - mixture_logp)).sum(-1) + (1 - beta) * (
            student_logp.exp() * (student_logp - mixture_logp)
        ).sum(-1)
    return div * temperature**2


def kd_loss(
    student_hidden: Tensor,
    student_project: Project,
    teacher_hidden: Tensor,
    teacher_project: Project,
    labels: Tensor,
    *,
    kind: Divergence = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    ce_weight: float = 0.0,
    num_chunks: int = 8,
    checkpoint_chunks: bool | None = None,
    reduction: Reduction = "mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """``(1 - ce_weight) * divergence + ce_weight * cross-entropy`` over the kept tokens.

    The cross-entropy is the student's, at temperature 1, against ``labels``. ``reduction`` as in
    ``linear_cross_entropy`` ("sum" for exact gradient accumulation). Metrics: the detached
    divergence and cross-entropy, reduced the same way.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not 0.0 <= ce_weight <= 1.0:
        raise ValueError(f"ce_weight must be in [0, 1], got {ce_weight}")
    if student_hidden.shape[:-1] != teacher_hidden.shape[:-1]:
        raise ValueError(
            f"student hidden {tuple(student_hidden.shape)} and teacher hidden "
            f"{tuple(teacher_hidden.shape)} cover different positions"
        )
    index = kept_indices(labels != IGNORE_INDEX)
    rows = (
        gather_rows(student_hidden, index, labels.shape),
        gather_rows(teacher_hidden, index, labels.shape),
        gather_rows(labels, index, labels.shape),
    )

    def chunk_losses(student_h: Tensor, teacher_h: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        student_logits = student_project(student_h).float()
        teacher_logits = teacher_project(teacher_h).float()
        if student_logits.shape[-1] != teacher_logits.shape[-1]:
            raise ValueError(
                f"student vocabulary {student_logits.shape[-1]} != teacher vocabulary {teacher_logits.shape[-1]}"
            )
        div = token_divergence(student_logits, teacher_logits, kind, beta, temperature)
        return div, F.cross_entropy(student_logits, y, reduction="none")

    div, ce = map_row_chunks(
        chunk_losses, rows, num_chunks, checkpoint_chunks, logits_width(student_project, teacher_project)
    )
    scale = 1.0 / max(index.numel(), 1) if reduction == "mean" else 1.0
    div_total, ce_total = div.sum() * scale, ce.sum() * scale
    loss = (1 - ce_weight) * div_total + ce_weight * ce_total
    return loss, {"kd/divergence": div_total.detach(), "kd/ce": ce_total.detach()}
