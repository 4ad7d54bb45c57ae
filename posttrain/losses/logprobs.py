"""Chunked per-token log-probabilities and entropies: the one implementation that SFT
cross-entropy, DPO, GRPO, evaluation and distillation all score tokens with.

Alignment contract (shared by every loss in ``posttrain.losses``): ``hidden`` is ``[B, S, D]``
(the model output after the final norm) and ``targets``/``labels`` are ``[B, S]`` *aligned with
it*: position ``t`` predicts ``labels[t]``. The data pipeline supplies labels already shifted left
by one, with ``IGNORE_INDEX`` (-100) on positions that must not count (prompt tokens, padding,
the last token of each packed document), so packed rows need no special handling here.
Log-softmax is always taken in float32, whatever the dtype of ``hidden``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.losses.chunked import (
    IGNORE_INDEX,
    Project,
    gather_rows,
    kept_indices,
    logits_width,
    map_row_chunks,
    scatter_rows,
)


def _resolve_mask(targets: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return targets != IGNORE_INDEX
    if mask.shape != targets.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != targets shape {tuple(targets.shape)}")
    return mask.bool()


def kept_token_logprobs(
    hidden: Tensor,
    project: Project,
    targets: Tensor,
    mask: Tensor | None = None,
    *,
    num_chunks: int = 8,
    temperature: float = 1.0,
    checkpoint_chunks: bool | None = None,
) -> Tensor:
    """Log-probs ``[N_kept]`` (float32) of ``targets`` at the kept positions, in row-major order.

    Positions outside ``mask`` (default: ``targets != -100``) are dropped before projecting, so
    they cost nothing. Masked-in positions must hold valid token ids.
    """
    mask = _resolve_mask(targets, mask)
    index = kept_indices(mask)
    rows = gather_rows(hidden, index, targets.shape)
    ids = gather_rows(targets, index, targets.shape)

    def chunk_logprobs(h: Tensor, y: Tensor) -> Tensor:
        logits = project(h).float() / temperature
        return -F.cross_entropy(logits, y, reduction="none")

    (logps,) = map_row_chunks(chunk_logprobs, (rows, ids), num_chunks, checkpoint_chunks, logits_width(project))
    return logps


def token_logprobs(
    hidden: Tensor,
    project: Project,
    targets: Tensor,
    mask: Tensor | None = None,
    *,
    num_chunks: int = 8,
    temperature: float = 1.0,
    checkpoint_chunks: bool | None = None,
) -> Tensor:
    """Per-token log-probs ``[B, S]`` (float32) of ``targets``; 0 where ``mask`` is False.

    ``temperature`` divides the logits, as the sampler did, so GRPO ratios compare like with like.
    """
    mask = _resolve_mask(targets, mask)
    logps = kept_token_logprobs(
        hidden,
        project,
        targets,
        mask,
        num_chunks=num_chunks,
        temperature=temperature,
        checkpoint_chunks=checkpoint_chunks,
    )
    return scatter_rows(logps, kept_indices(mask), targets.shape)


def sequence_logprobs(
    hidden: Tensor,
    project: Project,
    targets: Tensor,
    mask: Tensor | None = None,
    *,
    num_chunks: int = 8,
    temperature: float = 1.0,
    checkpoint_chunks: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Summed log-prob ``[B]`` of each row's kept targets and the kept-token count ``[B]``.

    DPO-style losses need the sum (sigmoid DPO) or the average (IPO, SimPO); the count lets the
    caller form either.
    """
    mask = _resolve_mask(targets, mask)
    logps = token_logprobs(
        hidden,
        project,
        targets,
        mask,
        num_chunks=num_chunks,
        temperature=temperature,
        checkpoint_chunks=checkpoint_chunks,
    )
    return logps.sum(-1), mask.sum(-1)


def token_logprobs_and_entropy(
    hidden: Tensor,
    project: Project,
    targets: Tensor,
    mask: Tensor | None = None,
    *,
    num_chunks: int = 8,
    temperature: float = 1.0,
    checkpoint_chunks: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token log-probs and entropies ``[B, S]`` (float32; 0 where masked) from one projection.

    GRPO logs the policy entropy each step; computing it in the same chunk pass as the log-probs
    avoids a second vocabulary projection. Both outputs are differentiable (an entropy bonus is
    possible); detach the entropy for logging.
    """
    mask = _resolve_mask(targets, mask)
    index = kept_indices(mask)
    rows = gather_rows(hidden, index, targets.shape)
    ids = gather_rows(targets, index, targets.shape)

    def chunk_logprobs_entropy(h: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        logp = torch.log_softmax(project(h).float() / temperature, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, y.unsqueeze(-1)).squeeze(-1), entropy

    logps, entropy = map_row_chunks(
        chunk_logprobs_entropy, (rows, ids), num_chunks, checkpoint_chunks, logits_width(project)
    )
    return scatter_rows(logps, index, targets.shape), scatter_rows(entropy, index, targets.shape)
