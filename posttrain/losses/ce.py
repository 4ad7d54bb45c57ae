"""Cross-entropy from hidden states, with and without materializing the logits.

``labels`` are aligned with ``hidden`` (position t predicts ``labels[t]``, -100 ignored); see
``posttrain.losses.logprobs`` for the contract. At a 150k vocabulary the ``[B, S, V]`` float32
logits and their gradient dominate a small model's training memory, so the default path
(:func:`linear_cross_entropy`) drops ignored tokens before projecting and projects and scores
the rest chunk by chunk under activation checkpointing.

Gradient accumulation: with ``reduction="sum"`` the caller divides by the token count of the
whole optimizer step (:func:`num_loss_tokens` summed over micro-batches and ranks), so every
token weighs the same however the tokens fall into micro-batches.
"""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from torch import Tensor

from posttrain.losses.chunked import IGNORE_INDEX, Project
from posttrain.losses.logprobs import kept_token_logprobs

Reduction = Literal["mean", "sum"]


def num_loss_tokens(labels: Tensor) -> Tensor:
    """Number of positions that count towards the loss (labels != -100)."""
    return (labels != IGNORE_INDEX).sum()


def linear_cross_entropy(
    hidden: Tensor,
    project: Project,
    labels: Tensor,
    num_chunks: int = 8,
    checkpoint_chunks: bool | None = None,
    reduction: Reduction = "mean",
) -> Tensor:
    """Cross-entropy (float32) of ``project(hidden)`` against ``labels`` without full logits.

    ``reduction="mean"`` averages over kept tokens (0 when there are none, instead of NaN);
    ``"sum"`` returns the total, to be normalized by the caller.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    logps = kept_token_logprobs(
        hidden, project, labels, num_chunks=num_chunks, checkpoint_chunks=checkpoint_chunks
    )
    total = -logps.sum()
    return total / max(logps.numel(), 1) if reduction == "mean" else total


def full_cross_entropy(
    hidden: Tensor, project: Project, labels: Tensor, reduction: Reduction = "mean"
) -> Tensor:
    """Cross-entropy through the full ``[B, S, V]`` logits.

    The baseline for memory benchmarks, and the path under tensor parallelism: with the output
    projection sharded on the vocabulary and ``loss_parallel()`` active, ``F.cross_entropy``
    works on the vocabulary-sharded DTensor logits directly.
    """
    logits = project(hidden)
    return F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction
    )
