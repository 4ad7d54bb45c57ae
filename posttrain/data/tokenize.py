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

from posttrain.data.chat import IGNORE_INDEX, render_check, shifted_labels, tokenize_chats, tokenize_texts
from posttrain.data.packing import pack_or_pad
from posttrain.data.sources import ORIGIN, BadRowError
from posttrain.tokenizer import Tokenizer

if TYPE_CHECKING:
    import datasets

TRUNCATION = ("right", "drop")
ROWS_PER_PROCESS = 20_000  # below this many rows per extra process, one process is faster


def _num_proc(n_rows: int) -> int | None:
    procs = min(len(os.sched_getaffinity(0)), n_rows // ROWS_PER_PROCESS)
    return procs if procs > 1 else None


def _map(rows: Sequence[dict[str, Any]], fields: Sequence[str], fn: Callable[[list[dict[str, Any]]], dict[str, list]],
         desc: str) -> datasets.Dataset:
    """Apply `fn` to batches of rows (their `fields`) with a progress bar, in several processes for large inputs; order kept.

    Rows travel as JSON text: Arrow would give every message (and every tool call's arguments) the
    union of all rows' keys, filled with nulls, which chat templates would render.
    """
    import datasets  # here: a training stage that tokenizes a few pairs need not hold it

    texts = [json.dumps({k: row[k] for k in fields if k in row}, ensure_ascii=False, default=str) for row in rows]
    ds = datasets.Dataset.from_dict({"row": texts})

    def decoded(batch: dict[str, list]) -> dict[str, list]:
        return fn([json.loads(text) for text in batch["row"]])

    return ds.map(decoded, batched=True, batch_size=256, remove_columns=["row"], num_proc=_num_proc(len(rows)), desc=desc)


def _encode_rows(tok: Tokenizer, prompts: Sequence[Any], completions: Sequence[Any], tools: Sequence[Any],
                 firsts: Sequence[int] | None, loss_mask: str) -> list[tuple[list[int], list[bool]]]:
    """(ids, trained mask) of each prompt + completion: chats (message lists) by the chat template with
    the completion's assistant messages trained, plain text (strings) as `tokenize_texts` does."""
    out: list[Any] = [None] * len(prompts)
    chat = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    text = [i for i, p in enumerate(prompts) if isinstance(p, str)]
    if chat:
        encoded = tokenize_chats(tok, [list(prompts[i]) + list(completions[i]) for i in chat], loss_mask,
                                 [len(prompts[i]) if firsts is None else firsts[i] for i in chat], [tools[i] for i in chat])
        for i, pair in zip(chat, encoded):
            out[i] = pair
    if text:
        for i, pair in zip(text, tokenize_texts(tok, [prompts[i] for i in text], [completions[i] for i in text], loss_mask)):
            out[i] = pair
    return out


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
    """Tokenize chats and plain-text rows, apply the loss mask and truncation, pack (or pad) into rows of `max_len`."""
    _check_truncation(truncation)

    def encode(batch: list[dict[str, Any]]) -> dict[str, list]:
        chats = ["messages" in row for row in batch]
        prompts = [[] if chat else row["prompt"] for chat, row in zip(chats, batch)]
        completions = [row["messages"] if chat else row["completion"] for chat, row in zip(chats, batch)]
        firsts = [row.get("completion_start", 0) for row in batch]
        ids, masks = zip(*_encode_rows(tok, prompts, completions, [row.get("tools") for row in batch], firsts, loss_mask))
        return {"ids": list(ids), "mask": list(masks)}

    encoded = _map(rows, ("messages", "tools", "completion_start", "prompt", "completion"), encode, desc)
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

    Chat rows render with the chat template (and their tools); plain-text rows (strings) as text.
    `keep`: row fields carried into the columns of the rows kept (the unpaired split's labels).
    """
    _check_truncation(truncation)

    def encode(batch: list[dict[str, Any]]) -> dict[str, list]:
        out = {}
        prompts, tools = [row["prompt"] for row in batch], [row.get("tools") for row in batch]
        for side in ("chosen", "rejected"):
            ids, masks = zip(*_encode_rows(tok, prompts, [row[side] for row in batch], tools, None, "assistant"))
            out[f"{side}_ids"], out[f"{side}_mask"] = list(ids), list(masks)
        return out

    rows = list(rows)
    encoded = _map(rows, ("prompt", "chosen", "rejected", "tools"), encode, "tokenize preference")
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
    Chat rows and plain-text rows are paired among their own kind (a mismatched completion must render
    under the other row's prompt), each in the order above.
    """
    rows = list(rows)
    partner = {}
    for plain in (False, True):
        group = [i for i, row in enumerate(rows) if isinstance(row["prompt"], str) == plain]
        partner.update({i: group[(k + len(group) // 2) % len(group)] for k, i in enumerate(group)})
    pairs = []
    for i, row in enumerate(rows):
        pair = {"prompt": row["prompt"], "chosen": row["completion"], "rejected": rows[partner[i]]["completion"],
                "desirable": row["desirable"]}
        if "tools" in row:
            pair["tools"] = row["tools"]
        pairs.append(pair)
    columns, stats = preference_split(pairs, tok, max_len, truncation, keep=("desirable",))
    stats["desirable_rows"] = sum(columns["desirable"])
    return columns, stats


def prompt_split(
    rows: Sequence[dict[str, Any]], tok: Tokenizer, max_len: int, desc: str = "tokenize prompts"
) -> tuple[dict[str, list], dict[str, Any]]:
    """Prompt ids (rendered with the generation prompt) plus id, task, answer and the verifier's example.

    A string prompt is one user turn; with `raw` (render: raw) it is plain text, tokenized as is.
    """

    def encode(batch: list[dict[str, Any]]) -> dict[str, list]:
        chat = [i for i, row in enumerate(batch) if not row.get("raw")]
        texts = [tok.apply_chat_template(as_messages(batch[i]["prompt"]), add_generation_prompt=True,
                                         tools=batch[i].get("tools")) for i in chat]
        ids: list[Any] = [tok.encode(row["prompt"], add_special_tokens=True) if row.get("raw") else None for row in batch]
        for i, prompt_ids in zip(chat, tok.encode_batch(texts)):
            ids[i] = prompt_ids
        return {"prompt_ids": ids}

    encoded = _map(rows, ("prompt", "tools", "raw"), encode, desc)
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


def as_messages(prompt: str | Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A prompt as messages: a string is one user turn."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def _texts(messages: str | Sequence[dict[str, Any]]) -> Iterator[str]:
    """Each message as `role\ncontent` (plus its reasoning and tool calls); plain text as it is."""
    if isinstance(messages, str):
        if messages:
            yield messages
        return
    for m in messages:
        extra = [m[k] if isinstance(m[k], str) else json.dumps(m[k], ensure_ascii=False)
                 for k in ("reasoning_content", "tool_calls") if k in m]
        yield "\n".join([f"{m['role']}\n{m.get('content') or ''}", *extra])


def tokenizer_training_text(rows: Mapping[str, Sequence[dict[str, Any]]]) -> Iterator[str]:
    """Every message of the training kinds of canonical rows (never eval), as `role\ncontent`, and the tools rows
    offer (as the template shows them: JSON), for BPE training."""
    for kind in ("sft", "preference", "unpaired", "prompts"):
        for row in rows.get(kind, []):
            if row.get("tools"):
                yield json.dumps(row["tools"], ensure_ascii=False)
    for row in rows.get("sft", []):
        yield from _texts(row["messages"]) if "messages" in row else (*_texts(row["prompt"]), *_texts(row["completion"]))
    for row in rows.get("preference", []):
        for field in ("prompt", "chosen", "rejected"):
            yield from _texts(row[field])
    for row in rows.get("unpaired", []):
        for field in ("prompt", "completion"):
            yield from _texts(row[field])
    for row in rows.get("prompts", []):
        yield from _texts(row["prompt"]) if row.get("raw") else _texts(as_messages(row["prompt"]))


def check_rendering(kind: str, rows: Sequence[dict[str, Any]], tok: Tokenizer,
                    skip_bad: bool) -> tuple[list[dict[str, Any]], int, int]:
    """The rows of a user source (those with an `origin`) that the tokenizer's chat template renders whole.

    A row the template raises on, or whose tool calls or tools it renders no differently than without
    them (a template without tool support), raises `BadRowError` naming source, row and field, or is
    skipped and counted. Returns (rows kept, bad rows skipped, messages whose reasoning_content the
    template did not render). Built-in task rows and plain-text rows are kept as they are.
    """
    kept, bad, unrendered = [], 0, 0
    for row in rows:
        origin = row.get(ORIGIN)
        plain = row.get("raw") if kind in ("prompts", "eval") else "messages" not in row and isinstance(row["prompt"], str)
        if origin is None or plain:
            kept.append(row)
            continue
        if kind == "sft":
            chats = [((("messages", 0),), row["messages"], False)]
        elif kind in ("prompts", "eval"):
            chats = [((("prompt", 0),), as_messages(row["prompt"]), True)]
        else:
            n = len(row["prompt"])
            sides = ("chosen", "rejected") if kind == "preference" else ("completion",)
            chats = [((("prompt", 0), (side, n)), row["prompt"] + row[side], False) for side in sides]
        try:
            for fields, messages, generation in chats:
                problem, count = render_check(tok, messages, row.get("tools"), generation)
                unrendered += count
                if problem is not None:
                    j, what = problem
                    if not isinstance(j, int):  # "tools", or the whole chat
                        raise BadRowError(f"{origin}: field {j or fields[-1][0]}: {what}")
                    field, start = next((f, s) for f, s in reversed(fields) if j >= s)
                    raise BadRowError(f"{origin}: field {field} message {j - start} {what}")
        except BadRowError:
            if not skip_bad:
                raise
            bad += 1
            continue
        kept.append(row)
    return kept, bad, unrendered
