"""Turn canonical rows (posttrain.data.sources) into the columns of each split, with counts.

Labels follow the contract of posttrain/losses/ce.py: `labels[t]` is the token position t is
trained to predict (the next token, already shifted within each document), -100 where nothing is
trained, at each document's last position and on padding.

Truncation (`right` cuts a row to `max_len` and counts it, `drop` drops and counts it) applies to
SFT and preference rows. Prompts longer than `max_len - 1` are always dropped and counted: a cut
prompt would ask a different question, and generation needs at least one free position.
A row left without any trained token (e.g. its answer was cut off) is dropped and counted too.
Each source row lands in exactly one count: kept (`truncated` counts the kept rows that were cut),
`dropped_too_long`, or `dropped_no_loss_tokens`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from posttrain.data.chat import IGNORE_INDEX, shifted_labels, tokenize_chats
from posttrain.data.packing import pack_or_pad
from posttrain.tokenizer import Tokenizer

if TYPE_CHECKING:
    import datasets

TRUNCATION = ("right", "drop")
ROWS_PER_PROCESS = 20_000  # below this many rows per extra process, one process is faster


def _num_proc(n_rows: int) -> int | None:
    procs = min(len(os.sched_getaffinity(0)), n_rows // ROWS_PER_PROCESS)
    return procs if procs > 1 else None


def _map(rows: list[dict[str, Any]], fn: Callable[[dict[str, list]], dict[str, list]], desc: str) -> datasets.Dataset:
    """Apply the batched `fn` to all rows with a progress bar, in several processes for large inputs; order kept."""
    import datasets  # here: a training stage that tokenizes a few pairs need not hold it

    ds = datasets.Dataset.from_list(rows)
    return ds.map(fn, batched=True, batch_size=256, remove_columns=ds.column_names, num_proc=_num_proc(len(rows)), desc=desc)


def _fit(ids: list[int], mask: list[bool], max_len: int, truncation: str) -> tuple[list[int], list[int]] | None:
    """(ids, labels) cut to `max_len`, or None when `drop` applies; the caller counts which."""
    if len(ids) > max_len:
        if truncation == "drop":
            return None
        ids, mask = ids[:max_len], mask[:max_len]
    return ids, shifted_labels(ids, mask)


def _check_truncation(truncation: str) -> None:
    if truncation not in TRUNCATION:
        raise ValueError(f"data.truncation must be one of {TRUNCATION}, got {truncation!r}")


def sft_split(
    rows: Sequence[dict[str, Any]], tok: Tokenizer, max_len: int, loss_mask: str, truncation: str, packing: bool,
    desc: str = "tokenize sft",
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Tokenize chats, apply the loss mask and truncation, and pack (or pad) them into rows of `max_len`."""
    _check_truncation(truncation)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        ids, masks = zip(*tokenize_chats(tok, batch["messages"], loss_mask))
        return {"ids": list(ids), "mask": list(masks)}

    encoded = _map(list(rows), encode, desc)
    docs_ids, docs_labels = [], []
    counts = {"truncated": 0, "dropped_too_long": 0, "dropped_no_loss_tokens": 0}
    for row in encoded:
        fitted = _fit(row["ids"], row["mask"], max_len, truncation)
        if fitted is None:
            counts["dropped_too_long"] += 1
            continue
        ids, labels = fitted
        if all(label == IGNORE_INDEX for label in labels):
            counts["dropped_no_loss_tokens"] += 1
            continue
        counts["truncated"] += len(row["ids"]) > max_len
        docs_ids.append(ids)
        docs_labels.append(labels)
    columns = pack_or_pad(docs_ids, docs_labels, max_len, tok.pad_id, packing)
    tokens = sum(len(d) for d in docs_ids)
    n_rows = len(columns["input_ids"])
    stats = {
        "source_rows": len(rows),
        "documents": len(docs_ids),
        "rows": n_rows,
        "tokens": tokens,
        "loss_tokens": int((columns["labels"] != IGNORE_INDEX).sum()),
        "padding_tokens": n_rows * max_len - tokens,
        "packing_efficiency": round(tokens / (n_rows * max_len), 6) if n_rows else 0.0,
        **counts,
    }
    return columns, stats


def preference_split(
    rows: Sequence[dict[str, Any]], tok: Tokenizer, max_len: int, truncation: str, keep: Sequence[str] = ()
) -> tuple[dict[str, list], dict[str, Any]]:
    """Tokenize prompt + chosen and prompt + rejected; only completion tokens are trained.

    `keep`: row fields carried into the columns of the rows kept (the unpaired split's labels).
    """
    _check_truncation(truncation)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        out = {}
        firsts = [len(prompt) for prompt in batch["prompt"]]
        for side in ("chosen", "rejected"):
            chats = [prompt + completion for prompt, completion in zip(batch["prompt"], batch[side])]
            ids, masks = zip(*tokenize_chats(tok, chats, "assistant", firsts))
            out[f"{side}_ids"], out[f"{side}_mask"] = list(ids), list(masks)
        return out

    encoded = _map(list(rows), encode, "tokenize preference")
    columns: dict[str, list] = {k: [] for k in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels",
                                                *keep)}
    counts = {"truncated": 0, "dropped_too_long": 0, "dropped_no_loss_tokens": 0}
    for source, row in zip(rows, encoded):
        fitted = {side: _fit(row[f"{side}_ids"], row[f"{side}_mask"], max_len, truncation) for side in ("chosen", "rejected")}
        if any(f is None for f in fitted.values()):
            counts["dropped_too_long"] += 1
            continue
        if any(all(label == IGNORE_INDEX for label in labels) for _, labels in fitted.values()):
            counts["dropped_no_loss_tokens"] += 1
            continue
        counts["truncated"] += any(len(row[f"{side}_ids"]) > max_len for side in ("chosen", "rejected"))
        for side, (ids, labels) in fitted.items():
            columns[f"{side}_input_ids"].append(ids)
            columns[f"{side}_labels"].append(labels)
        for field in keep:
            columns[field].append(source[field])
    all_labels = columns["chosen_labels"] + columns["rejected_labels"]
    stats = {
        "source_rows": len(rows),
        "rows": len(columns["chosen_input_ids"]),
        "tokens": sum(len(ids) for ids in columns["chosen_input_ids"] + columns["rejected_input_ids"]),
        "loss_tokens": sum(sum(label != IGNORE_INDEX for label in labels) for labels in all_labels),
        **counts,
    }
    return columns, stats


def unpaired_split(
    rows: Sequence[dict[str, Any]], tok: Tokenizer, max_len: int, truncation: str
) -> tuple[dict[str, list], dict[str, Any]]:
    """Unpaired rows (KTO) in the preference split's columns, so one pair machinery scores both.

    Row i's `chosen` side is its own completion; its `rejected` side is the completion of row
    (i + n // 2) % n under row i's prompt: a mismatched pair, the sample KTO's KL reference point
    is estimated on (Ethayarajh et al. 2024). Half a split away, it shares no prompt with row i when
    the rows come two per pair (`sources.unpair`) and there are more than two. `desirable` is each row's label.
    """
    rows = list(rows)
    n = len(rows)
    pairs = [{"prompt": row["prompt"], "chosen": row["completion"], "rejected": rows[(i + n // 2) % n]["completion"],
              "desirable": row["desirable"]} for i, row in enumerate(rows)]
    columns, stats = preference_split(pairs, tok, max_len, truncation, keep=("desirable",))
    stats["desirable_rows"] = sum(columns["desirable"])
    return columns, stats


def prompt_split(
    rows: Sequence[dict[str, Any]], tok: Tokenizer, max_len: int, desc: str = "tokenize prompts"
) -> tuple[dict[str, list], dict[str, Any]]:
    """Prompt ids (rendered with the generation prompt) plus id, task, answer and the verifier's example."""

    def encode(batch: dict[str, list]) -> dict[str, list]:
        texts = [tok.apply_chat_template(messages, add_generation_prompt=True) for messages in batch["messages"]]
        return {"prompt_ids": tok.encode_batch(texts)}

    as_chat = [{"messages": [{"role": "user", "content": r["prompt"]}] if isinstance(r["prompt"], str) else r["prompt"]}
               for r in rows]
    encoded = _map(as_chat, encode, desc)
    columns: dict[str, list] = {"prompt_ids": [], "id": [], "task": [], "answer": [], "example": []}
    dropped = 0
    for row, enc in zip(rows, encoded):
        if len(enc["prompt_ids"]) >= max_len:
            dropped += 1
            continue
        columns["prompt_ids"].append(enc["prompt_ids"])
        for key in ("id", "task", "answer"):
            columns[key].append(row[key])
        columns["example"].append(json.dumps(row["example"], ensure_ascii=False, default=str))
    stats = {
        "source_rows": len(rows),
        "rows": len(columns["prompt_ids"]),
        "tokens": sum(len(ids) for ids in columns["prompt_ids"]),
        "dropped_too_long": dropped,
    }
    return columns, stats


def tokenizer_training_text(rows: Mapping[str, Sequence[dict[str, Any]]]) -> Iterator[str]:
    """Every message of the training kinds of canonical rows (never eval), as `role\ncontent`, for BPE training."""
    for row in rows.get("sft", []):
        yield from (f"{m['role']}\n{m['content']}" for m in row["messages"])
    for row in rows.get("preference", []):
        yield from (f"{m['role']}\n{m['content']}" for m in row["prompt"] + row["chosen"] + row["rejected"])
    for row in rows.get("unpaired", []):
        yield from (f"{m['role']}\n{m['content']}" for m in row["prompt"] + row["completion"])
    for row in rows.get("prompts", []):
        prompt = row["prompt"]
        yield from ([f"user\n{prompt}"] if isinstance(prompt, str) else (f"{m['role']}\n{m['content']}" for m in prompt))
