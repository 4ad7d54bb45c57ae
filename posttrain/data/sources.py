"""Data sources: local files and hub datasets, mapped onto one canonical row per kind.

Kinds and their canonical rows (field names are the defaults of a source's `columns` mapping):

- `sft`: `{"messages": [{"role", "content"}, ...]}`, from a `messages` column or from `prompt` and
  `response` columns (plus an optional `system` column).
- `preference`: `{"prompt": messages, "chosen": messages, "rejected": messages}`; `prompt` is a
  string (one user turn) or a message list, `chosen`/`rejected` a string (one assistant turn) or
  the completion's message list.
- `unpaired`: `{"prompt": messages, "completion": messages, "desirable": bool}`: one completion with
  a thumbs up or down (`label`: true/false or 1/0), for KTO;
- `prompts` / `eval`: `{"id", "task", "prompt", "answer", "example"}`; `example` is the whole row
  (prompt, answer, task, id and every other column) handed to the verifiers.

A row that lacks a field or has one of the wrong type raises `BadRowError` naming the source, the
row index and the field, unless the caller asks to skip bad rows (then they are counted).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet

KINDS = ("sft", "preference", "unpaired", "prompts", "eval")
TASK_KINDS = ("sft", "preference", "prompts", "eval")  # the kinds the built-in tasks generate (data.n_<kind> rows)
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Canonical field -> default source column, per kind.
DEFAULT_COLUMNS: dict[str, dict[str, str]] = {
    "sft": {"messages": "messages", "prompt": "prompt", "response": "response", "system": "system"},
    "preference": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "system": "system"},
    "unpaired": {"prompt": "prompt", "completion": "completion", "label": "label", "system": "system"},
    "prompts": {"prompt": "prompt", "answer": "answer", "task": "task", "id": "id", "system": "system"},
    "eval": {"prompt": "prompt", "answer": "answer", "task": "task", "id": "id", "system": "system"},
}
# How the built-in tasks' rows (posttrain.data.tasks) map onto each kind.
TASK_COLUMNS: dict[str, dict[str, str]] = {
    "sft": {}, "preference": {"chosen": "response", "rejected": "rejected_response"}, "prompts": {}, "eval": {},
}


class DataError(ValueError):
    """Data that cannot be loaded or used."""


class BadRowError(DataError):
    """One row with a missing or malformed field."""


def _is_offline() -> bool:
    return any(os.environ.get(v, "0").lower() not in ("", "0", "false", "no") for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def _read_json_rows(path: Path) -> list[Any]:
    """JSON lines or a JSON array, parsed row by row so one odd row gets its own error, not Arrow's."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip()[:1] in ("[", "{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"data source {path}: invalid JSON ({err})") from err
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise DataError(f"data source {path}: a .json source must hold a list of rows (or {{'data': [...]}})")
        return data
    rows = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataError(f"data source {path}: line {line_no}: invalid JSON ({err})") from err
    return rows


def load_source(
    path: str, split: str | None = None, subset: str | None = None, revision: str | None = None
) -> Sequence[Any]:
    """Rows of a local `.jsonl/.json/.parquet/.csv` file, or of a hub dataset id (`split`, `subset`, `revision`).

    Parquet is read with pyarrow (what the training stages read, the reward stage's pairs, needs
    nothing heavier); CSV and hub datasets load through `datasets`, imported only then. JSON is
    parsed row by row so that a row of the wrong shape is reported as a bad row rather than as an
    Arrow schema error.
    """
    local = Path(path)
    if local.suffix in LOCAL_FORMATS or local.exists():
        if not local.is_file():
            raise DataError(f"data source {path}: no such file")
        if local.suffix not in LOCAL_FORMATS:
            raise DataError(f"data source {path}: unknown format; use one of {', '.join(LOCAL_FORMATS)}")
        if LOCAL_FORMATS[local.suffix] == "json":
            return _read_json_rows(local)
        try:
            if LOCAL_FORMATS[local.suffix] == "parquet":
                return pyarrow.parquet.read_table(local).to_pylist()
            import datasets

            return datasets.load_dataset(LOCAL_FORMATS[local.suffix], data_files=str(local), split="train")
        except Exception as err:  # the builders raise many types; name the file once
            raise DataError(f"data source {path}: cannot be read as {local.suffix[1:]} ({type(err).__name__}: {err})") from err
    import datasets

    try:
        return datasets.load_dataset(path, subset, split=split or "train", revision=revision)
    except Exception as err:
        why = "offline mode is set (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE)" if _is_offline() else f"{type(err).__name__}: {err}"
        raise DataError(
            f"data source {path!r} (hub dataset, split {split or 'train'!r}, subset {subset!r}, revision {revision!r}) "
            f"could not be loaded: {why}. To use it offline, download it where the hub is reachable, save it as a "
            f"local .jsonl/.json/.parquet/.csv file, and set that file as the source's `path`."
        ) from err


class _RowChecker:
    """Reads canonical fields of one row, raising `BadRowError` that names source, row and field."""

    def __init__(self, where: str, index: int, row: Mapping[str, Any], columns: Mapping[str, str]):
        self.where, self.index, self.row, self.columns = where, index, row, columns

    def bad(self, field: str, problem: str) -> BadRowError:
        column = self.columns.get(field, field)
        name = field if column == field else f"{field} (column {column!r})"
        return BadRowError(f"{self.where}: row {self.index}: field {name} {problem}")

    def has(self, field: str) -> bool:
        return self.row.get(self.columns.get(field, field)) is not None

    def get(self, field: str) -> Any:
        value = self.row.get(self.columns.get(field, field))
        if value is None:
            raise self.bad(field, "is missing")
        return value

    def text(self, field: str, numbers_ok: bool = False) -> str:
        value = self.get(field)
        if numbers_ok and isinstance(value, (int, float)) and not isinstance(value, bool):
            # CSV integer columns with an empty cell load as floats: 3.0 is the answer "3".
            return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
        if not isinstance(value, str):
            raise self.bad(field, f"must be a string, got {type(value).__name__}")
        return value

    def messages(self, field: str, default_role: str) -> list[dict[str, str]]:
        """A string (one turn of `default_role`) or a list of {role, content} messages."""
        value = self.get(field)
        if isinstance(value, str):
            return [{"role": default_role, "content": value}]
        if not isinstance(value, list) or not value:
            raise self.bad(field, f"must be a string or a non-empty list of messages, got {type(value).__name__}")
        out = []
        for j, message in enumerate(value):
            if not isinstance(message, Mapping):
                raise self.bad(field, f"message {j} must be a mapping with role and content, got {type(message).__name__}")
            for key in ("role", "content"):
                if not isinstance(message.get(key), str):
                    got = "missing" if message.get(key) is None else type(message[key]).__name__
                    raise self.bad(field, f"message {j} needs a string {key!r} ({got})")
            out.append({"role": message["role"], "content": message["content"]})
        return out

    def with_system(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        if self.has("system") and messages[0]["role"] != "system":
            return [{"role": "system", "content": self.text("system")}, *messages]
        return messages


def _sft(c: _RowChecker) -> dict[str, Any]:
    if c.has("messages"):
        messages = c.messages("messages", "user")
    elif c.has("prompt") or c.has("response"):
        messages = [{"role": "user", "content": c.text("prompt")}, {"role": "assistant", "content": c.text("response")}]
    else:
        raise c.bad("messages", "is missing (give a messages column, or prompt and response columns)")
    if not any(m["role"] == "assistant" for m in messages):
        raise c.bad("messages", "has no assistant message to train on")
    return {"messages": c.with_system(messages)}


def _preference(c: _RowChecker) -> dict[str, Any]:
    prompt = c.with_system(c.messages("prompt", "user"))
    pair = {}
    for field in ("chosen", "rejected"):
        completion = c.messages(field, "assistant")
        if not any(m["role"] == "assistant" for m in completion):
            raise c.bad(field, "has no assistant message")
        pair[field] = completion
    return {"prompt": prompt, **pair}


def _unpaired(c: _RowChecker) -> dict[str, Any]:
    prompt = c.with_system(c.messages("prompt", "user"))
    completion = c.messages("completion", "assistant")
    if not any(m["role"] == "assistant" for m in completion):
        raise c.bad("completion", "has no assistant message")
    label = c.get("label")
    if label not in (True, False) or isinstance(label, float):  # bool, or the ints 1 and 0
        raise c.bad("label", f"must be true/false (or 1/0), got {label!r}")
    return {"prompt": prompt, "completion": completion, "desirable": bool(label)}


def unpair(pairs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each preference pair as two unpaired rows: its chosen completion desirable, its rejected one not."""
    return [{"prompt": pair["prompt"], "completion": pair[side], "desirable": side == "chosen"}
            for pair in pairs for side in ("chosen", "rejected")]


def _prompt(c: _RowChecker) -> dict[str, Any]:
    prompt = c.get("prompt")
    if not isinstance(prompt, str):  # a message list: validated, kept as given
        prompt = c.with_system(c.messages("prompt", "user"))
    answer = c.text("answer", numbers_ok=True)
    task = c.text("task") if c.has("task") else ""
    row_id = c.text("id", numbers_ok=True) if c.has("id") else f"{c.where}#{c.index}"
    mapped = {c.columns.get(f, f) for f in ("prompt", "answer", "task", "id")}
    example = {k: v for k, v in c.row.items() if k not in mapped}
    example.update({"id": row_id, "task": task, "prompt": prompt, "answer": answer})
    return {"id": row_id, "task": task, "prompt": prompt, "answer": answer, "example": example}


_CANONICAL = {"sft": _sft, "preference": _preference, "unpaired": _unpaired, "prompts": _prompt, "eval": _prompt}


def canonical_rows(
    rows: Iterable[Mapping[str, Any]], kind: str, where: str, columns: Mapping[str, str] | None = None, skip_bad: bool = False
) -> tuple[list[dict[str, Any]], int]:
    """Map raw rows onto the canonical rows of `kind`; returns (rows, number of bad rows skipped)."""
    if kind not in KINDS:
        raise DataError(f"{where}: unknown data kind {kind!r}; kinds: {', '.join(KINDS)}")
    mapping = {**DEFAULT_COLUMNS[kind], **(columns or {})}
    unknown = sorted(set(columns or {}) - set(DEFAULT_COLUMNS[kind]))
    if unknown:
        raise DataError(f"{where}: columns: unknown field(s) {unknown} for kind {kind!r}; fields: {sorted(DEFAULT_COLUMNS[kind])}")
    out, bad = [], 0
    for index, row in enumerate(rows):
        try:
            if not isinstance(row, Mapping):
                raise BadRowError(f"{where}: row {index}: must be an object of fields, got {type(row).__name__}")
            out.append(_CANONICAL[kind](_RowChecker(where, index, row, mapping)))
        except BadRowError:
            if not skip_bad:
                raise
            bad += 1
    return out, bad
