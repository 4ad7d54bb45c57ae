"""Row-chunked evaluation of per-token functions of the output projection.

Every vocabulary-sized quantity in posttrain (cross-entropy, token log-probs, entropy, KD
divergences) is a per-row function of ``project(hidden_row)``. This module keeps only the rows
that count, splits them into chunks, and evaluates each chunk, optionally under activation
checkpointing, so that at most one chunk's ``[rows, vocab]`` logits exist at a time in the
forward *and* the backward pass. The per-row results (a few floats per token) are concatenated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
"""Label value of positions that contribute nothing (prompt tokens, padding, document ends)."""

RECOMPUTE_ABOVE_MIB = 64
"""With ``checkpoint_chunks=None`` (the default) the chunks are recomputed in backward only when
keeping the float32 logits of all of them would take more than this many MiB. Below it the logits
weigh less than a small model's activations, while recomputing costs a second output projection
per chunk (about a tenth of such a model's step); at real vocabularies (151,936 x 110 tokens is
already 64 MiB) the chunks are always recomputed."""

Project = Callable[[Tensor], Tensor]
"""Maps hidden rows ``[N, D]`` to logits ``[N, V]``; pass the model's ``lm_head`` module itself
(calling the module, not reading its weight, keeps FSDP2's hooks working)."""


def kept_indices(mask: Tensor) -> Tensor:
    """Flat indices of the True positions of ``mask`` (any shape)."""
    return mask.reshape(-1).nonzero().squeeze(1)


def gather_rows(x: Tensor, index: Tensor, lead_shape: torch.Size) -> Tensor:
    """Rows of ``x`` (leading dims ``lead_shape``, then features or nothing) at flat ``index``."""
    if x.shape[: len(lead_shape)] != lead_shape:
        raise ValueError(f"expected leading shape {tuple(lead_shape)}, got {tuple(x.shape)}")
    return x.reshape(lead_shape.numel(), *x.shape[len(lead_shape) :]).index_select(0, index)


def scatter_rows(values: Tensor, index: Tensor, shape: torch.Size) -> Tensor:
    """Inverse of :func:`gather_rows` for per-row scalars: zeros of ``shape`` with ``values`` at ``index``."""
    out = values.new_zeros(shape.numel())
    return out.index_put((index,), values).view(shape)


def logits_width(*projects: Project) -> int | None:
    """Total output width of ``projects`` (their weights' rows); None when one has no weight to read it from."""
    widths = [getattr(p, "weight", None) for p in projects]
    return None if any(w is None for w in widths) else sum(w.shape[0] for w in widths)


def should_recompute(checkpoint_chunks: bool | None, rows: int, width: int | None) -> bool:
    """Resolve ``checkpoint_chunks``: an explicit bool stands; None recomputes above ``RECOMPUTE_ABOVE_MIB``."""
    if checkpoint_chunks is not None:
        return checkpoint_chunks
    return width is None or rows * width * 4 > RECOMPUTE_ABOVE_MIB * 2**20


def map_row_chunks(
    fn: Callable[..., Tensor | tuple[Tensor, ...]],
    rows: Sequence[Tensor],
    num_chunks: int,
    checkpoint_chunks: bool | None = None,
    width: int | None = None,
) -> tuple[Tensor, ...]:
    """Apply ``fn`` to ``num_chunks`` consecutive slices of ``rows`` and concatenate the results.

    ``rows`` are tensors sharing their first dimension N (hidden rows, targets, teacher rows...);
    ``fn(*row_slices)`` returns one tensor or a tuple of tensors whose first dimension is the
    slice length. Under ``checkpoint_chunks`` each call is recomputed in backward instead of
    keeping its intermediates (the logits), so only one chunk's logits are ever alive; None
    decides by the size of all the logits (``width`` columns per row, see ``should_recompute``).
    Chunks exist to bound memory, so when gradients are tracked and the logits are kept they are
    one chunk: all of them stay alive for backward anyway, and each chunk would cost its own
    output-projection matmuls (measured, one CPU thread, vocabulary 4,096, width 256: the weight
    gradient of 225 rows takes 11 ms in one matmul, 31 ms as 8 chunks of 28 rows). Without
    gradients each chunk's logits are freed before the next, so the chunks stay.
    With N == 0, ``fn`` still runs once on the empty rows so the loss stays connected to the
    projection's parameters (every rank of a sharded model must take part in backward).
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    n = rows[0].shape[0]
    if any(r.shape[0] != n for r in rows):
        raise ValueError(f"row tensors disagree on length: {[tuple(r.shape) for r in rows]}")
    use_checkpoint = torch.is_grad_enabled() and should_recompute(checkpoint_chunks, n, width)
    if torch.is_grad_enabled() and not use_checkpoint:
        num_chunks = 1  # every kept chunk's logits live until backward: splitting saves nothing, costs a matmul per chunk
    slices = [s for s in zip(*(r.tensor_split(num_chunks) for r in rows)) if s[0].shape[0] > 0]
    outputs: list[tuple[Tensor, ...]] = []
    for chunk in slices or [tuple(rows)]:
        out = checkpoint(fn, *chunk, use_reentrant=False) if use_checkpoint else fn(*chunk)
        outputs.append(out if isinstance(out, tuple) else (out,))
    return tuple(torch.cat(parts) for parts in zip(*outputs))
