"""Pack tokenized documents into fixed-length rows with document boundaries (or pad one per row).

Each row stores `input_ids`, `labels` and `document_ids` of length `max_len`. Documents in a row get
ids 0, 1, ...; the padding tail is one more document of its own (labels -100), so per-document
attention keeps it away from real tokens and every position attends to at least itself.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch

from posttrain.losses.chunked import IGNORE_INDEX


def best_fit_decreasing(lengths: Sequence[int], max_len: int) -> list[list[int]]:
    """Group document indices into rows of total length <= `max_len`.

    Longest documents first, each into the row with the least room that still fits it (ties: the
    older row), else a new row. Deterministic; rows come back ordered by their first document and
    each row lists its documents in data order.
    """
    if any(n > max_len or n <= 0 for n in lengths):
        raise ValueError(f"every document must have 1..{max_len} tokens to be packed")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    shortest = min(lengths, default=1)
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, row index), sorted
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(room, (n, -1))
        if at < len(room):
            free, r = room.pop(at)
        else:
            free, r = max_len, len(rows)
            rows.append([])
        rows[r].append(i)
        if free - n >= shortest:  # rows that no document can fill further leave the search
            bisect.insort(room, (free - n, r))
    for row in rows:
        row.sort()
    rows.sort(key=lambda row: row[0])
    return rows


def build_rows(
    docs_ids: Sequence[Sequence[int]],
    docs_labels: Sequence[Sequence[int]],
    rows: Sequence[Sequence[int]],
    max_len: int,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """int32 arrays [len(rows), max_len] of `input_ids`, `labels`, `document_ids` for the given grouping."""
    input_ids = np.full((len(rows), max_len), pad_id, dtype=np.int32)
    labels = np.full((len(rows), max_len), IGNORE_INDEX, dtype=np.int32)
    document_ids = np.empty((len(rows), max_len), dtype=np.int32)
    for r, row in enumerate(rows):
        pos = 0
        for d, doc in enumerate(row):
            n = len(docs_ids[doc])
            input_ids[r, pos : pos + n] = docs_ids[doc]
            labels[r, pos : pos + n] = docs_labels[doc]
            document_ids[r, pos : pos + n] = d
            pos += n
        document_ids[r, pos:] = len(row)
    return {"input_ids": input_ids, "labels": labels, "document_ids": document_ids}


def pack_or_pad(
    docs_ids: Sequence[Sequence[int]], docs_labels: Sequence[Sequence[int]], max_len: int, pad_id: int, packing: bool
) -> dict[str, np.ndarray]:
    """Packed rows (best-fit decreasing) or one padded document per row (for comparison)."""
    lengths = [len(d) for d in docs_ids]
    rows = best_fit_decreasing(lengths, max_len) if packing else [[i] for i in range(len(lengths))]
    return build_rows(docs_ids, docs_labels, rows, max_len, pad_id)


def shortest_rows(lengths: Sequence[int], rows: int, max_len: int, multiple: int) -> list[list[int]]:
    """`best_fit_decreasing` into at most `rows` rows, of the shortest length (a multiple of
    `multiple`, else `max_len`) at which it still fits them in that many (MULTIFIT's bisection).

    Rows that are trimmed to their longest then cost the fewest positions. `lengths` must fit in
    `rows` rows of `max_len`.
    """
    shortest = max(max(lengths), -(-sum(lengths) // rows))
    capacities = [*range(-(-shortest // multiple) * multiple, max_len, multiple), max_len]
    low, high = 0, len(capacities) - 1
    best = best_fit_decreasing(lengths, max_len)
    while low < high:
        mid = (low + high) // 2
        groups = best_fit_decreasing(lengths, capacities[mid])
        if len(groups) <= rows:
            best, high = groups, mid
        else:
            low = mid + 1
    return best


def repack_trained_spans(
    input_ids: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor, multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[rows, L] SFT rows with each row's span up to its last trained token packed into as few rows as fit.

    Attention is causal and per document, so what follows a row's last trained token changes no
    loss term: each row's span is a unit that can share a row with others (the same loss, fewer
    positions computed: padding-free batches). The spans are spread over those rows so that the
    fullest is as short as it can be, to a multiple of `multiple` (`shortest_rows`): the batch is
    then trimmed to it. The new rows are laid out by `build_rows` from the spans' documents (token 0
    in the tail). The rows come back unchanged unless packing saves at least one row.
    """
    rows, width = input_ids.shape
    trained = labels != IGNORE_INDEX
    ends = torch.where(trained.any(1), width - trained.flip(1).int().argmax(1), 0).tolist()
    spans = [r for r in range(rows) if ends[r]]
    lengths = [ends[r] for r in spans]
    groups = best_fit_decreasing(lengths, width) if spans else []
    if not spans or len(groups) >= rows:
        return input_ids, labels, document_ids
    groups = shortest_rows(lengths, len(groups), width, multiple)
    docs_ids: list[torch.Tensor] = []
    docs_labels: list[torch.Tensor] = []
    span_docs: list[list[int]] = []  # per span: its documents' indices in docs_ids
    for r in spans:
        sizes = torch.unique_consecutive(document_ids[r, : ends[r]], return_counts=True)[1].tolist()
        span_docs.append(list(range(len(docs_ids), len(docs_ids) + len(sizes))))
        docs_ids += input_ids[r, : ends[r]].split(sizes)
        docs_labels += labels[r, : ends[r]].split(sizes)
    out = build_rows(docs_ids, docs_labels, [[d for i in group for d in span_docs[i]] for group in groups], width, 0)
    return tuple(torch.from_numpy(out[k]).to(input_ids.dtype)
                 for k in ("input_ids", "labels", "document_ids"))  # type: ignore[return-value]
