"""Data sources: local files and folders, hub datasets, mapped onto one canonical row per kind.

The shapes read are TRL's dataset formats (language modeling, prompt-only, prompt-completion,
preference with an explicit or implicit prompt, unpaired preference), each in its standard form
(strings) or its conversational form (message lists), plus ShareGPT's `from`/`value` messages,
OpenAI's tool calls, and Anthropic HH-RLHF's `\\n\\nHuman: ... \\n\\nAssistant: ...` text pairs.
docs/data.md has the table of shapes; a source's `columns` maps each canonical field onto a column.

Kinds and their canonical rows:

- `sft`: `{"messages": [message, ...]}` (plus `tools` and, for a prompt-completion row whose
  prompt holds assistant turns, `completion_start`: the first message trained), from a `messages`
  (or ShareGPT `conversations`) column, or from `prompt` and `completion` (or `response`) columns
  plus an optional `system` column; or plain text `{"prompt": str, "completion": str}` from a
  `text` column (language modeling: the prompt is empty) or from string prompt/completion with
  `render: raw`.
- `preference`: `{"prompt": messages, "chosen": messages, "rejected": messages}` (plus `tools`);
  `prompt` is a string (one user turn) or a message list, `chosen`/`rejected` a string (one
  assistant turn) or the completion's message list. A conversation that repeats the prompt at its
  head (UltraFeedback) is cut after it; without a prompt column the prompt is the longest common
  head of chosen and rejected (TRL's implicit prompt). With `render: raw`: strings throughout.
- `unpaired`: `{"prompt": messages, "completion": messages, "desirable": bool}`: one completion with
  a thumbs up or down (`label`: true/false or 1/0), for KTO;
- `prompts` / `eval`: `{"id", "task", "prompt", "answer", "example"}` (plus `tools`, and `raw`:
  true with `render: raw`); `example` is the whole row (prompt, answer, task, id and every other
  column) handed to the verifiers.

Messages keep every field they bring besides `role` and `content` (`tool_calls`, `tool_call_id`,
`name`, `reasoning_content`, ...) for the chat template to render, as `transformers` hands them to
it; `content` may be null on an assistant message with tool calls. Tool-call arguments given as a
JSON string are parsed into the object chat templates expect.

A row that lacks a field or has one of the wrong type raises `BadRowError` naming the source, the
row index and the field, unless the caller asks to skip bad rows (then they are counted).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet

KINDS = ("sft", "preference", "unpaired", "prompts", "eval")
TASK_KINDS = ("sft", "preference", "prompts", "eval")  # the kinds the built-in tasks generate (data.n_<kind> rows)
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
RENDERS = ("chat", "raw")
# Canonical field -> default source column, per kind.
DEFAULT_COLUMNS: dict[str, dict[str, str]] = {
    "sft": {"messages": "messages", "text": "text", "prompt": "prompt", "completion": "completion", "response": "response",
            "system": "system", "tools": "tools"},
    "preference": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "system": "system", "tools": "tools"},
    "unpaired": {"prompt": "prompt", "completion": "completion", "label": "label", "system": "system", "tools": "tools"},
    "prompts": {"prompt": "prompt", "answer": "answer", "task": "task", "id": "id", "system": "system", "tools": "tools"},
    "eval": {"prompt": "prompt", "answer": "answer", "task": "task", "id": "id", "system": "system", "tools": "tools"},
}
# Every field a source's `columns` may map (the config schema's `columns` names exactly these).
COLUMN_FIELDS = tuple(sorted({field for fields in DEFAULT_COLUMNS.values() for field in fields}))
# A field whose column is absent, and not mapped, is also looked for under these columns.
ALTERNATE_COLUMNS = {"messages": ("conversations",)}  # ShareGPT
# ShareGPT speakers (`from`) -> roles; a source's `roles` adds to or overrides these.
SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
    "function_call": "assistant", "observation": "tool", "tool": "tool",
}
# How the built-in tasks' rows (posttrain.data.tasks) map onto each kind.
TASK_COLUMNS: dict[str, dict[str, str]] = {
    "sft": {}, "preference": {"chosen": "response", "rejected": "rejected_response"}, "prompts": {}, "eval": {},
}
ORIGIN = "origin"  # the key collect_rows adds to a user source's rows: "<source>: row <i>", for later errors
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")


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


def _split_indices(path: str, split: str | None, lengths: Mapping[str, int]) -> list[tuple[str, range]]:
    """(split name, row range) pieces that a split spec such as `train`, `train[:100]`, `test[10%:]` selects."""
    import datasets

    try:
        pieces = datasets.ReadInstruction.from_spec(split).to_absolute(dict(lengths))
    except (ValueError, AssertionError) as err:
        raise DataError(f"data source {path}: split {split!r}: {err}") from err
    return [(p.splitname, range(p.from_ if p.from_ is not None else 0, p.to if p.to is not None else lengths[p.splitname]))
            for p in pieces]


def _select(path: str, split: str | None, rows: Sequence[Any], name: str = "train") -> tuple[Sequence[Any], list[int]]:
    """The rows of one split that `split` selects, with their row numbers in it."""
    if split is None:
        return rows, list(range(len(rows)))
    indices = [i for _, part in _split_indices(path, split, {name: len(rows)}) for i in part]
    if indices == list(range(len(rows))):
        return rows, indices
    if hasattr(rows, "select"):
        return rows.select(indices), indices
    return [rows[i] for i in indices], indices


def _load_from_disk(folder: Path, split: str | None) -> tuple[Sequence[Any], list[int]]:
    """A `datasets.save_to_disk` folder: a Dataset (its one split) or a DatasetDict (`split`, train by default)."""
    import datasets

    try:
        saved = datasets.load_from_disk(str(folder))
    except Exception as err:
        raise DataError(f"data source {folder}: cannot be read as a save_to_disk folder ({type(err).__name__}: {err})") from err
    if isinstance(saved, datasets.DatasetDict):
        lengths = {name: len(ds) for name, ds in saved.items()}
        pieces = _split_indices(str(folder), split or "train", lengths)
        if len(pieces) == 1 and pieces[0][1] == range(lengths[pieces[0][0]]):
            name = pieces[0][0]
            return saved[name], list(range(len(saved[name])))
        rows = [saved[name][i] for name, part in pieces for i in part]
        return rows, [i for _, part in pieces for i in part]
    return _select(str(folder), split, saved, str(saved.split) if saved.split else "train")


def load_rows(
    path: str, split: str | None = None, subset: str | None = None, revision: str | None = None,
    data_files: str | Sequence[str] | Mapping[str, Any] | None = None,
) -> tuple[Sequence[Any], list[int]]:
    """`load_source`'s rows and each one's row number in its split (what errors name)."""
    local = Path(path).expanduser()
    if local.is_dir():
        if data_files is None and ((local / "dataset_dict.json").is_file() or (local / "state.json").is_file()):
            if subset is not None:
                raise DataError(f"data source {path}: a save_to_disk folder has no subsets (subset {subset!r})")
            return _load_from_disk(local, split)
        import datasets

        try:  # a folder of data files, laid out as on the hub (splits by file name, or `data_files`)
            rows = datasets.load_dataset(str(local), subset, split=split or "train", data_files=data_files)
        except Exception as err:
            raise DataError(f"data source {path} (local dataset folder, split {split or 'train'!r}, subset {subset!r}, "
                            f"data_files {data_files!r}) could not be loaded: {type(err).__name__}: {err}") from err
        return rows, list(range(len(rows)))
    if local.suffix in LOCAL_FORMATS or local.exists():
        if not local.is_file():
            raise DataError(f"data source {path}: no such file")
        if local.suffix not in LOCAL_FORMATS:
            raise DataError(f"data source {path}: unknown format; use one of {', '.join(LOCAL_FORMATS)}, "
                            "a folder of them, or a save_to_disk folder")
        if data_files is not None:
            raise DataError(f"data source {path}: data_files applies to a dataset folder or hub id, not to one file")
        if subset is not None:
            raise DataError(f"data source {path}: a local file has no subsets (subset {subset!r})")
        if LOCAL_FORMATS[local.suffix] == "json":
            rows: Sequence[Any] = _read_json_rows(local)
        else:
            try:
                if LOCAL_FORMATS[local.suffix] == "parquet":
                    rows = pyarrow.parquet.read_table(local).to_pylist()
                else:
                    import datasets

                    rows = datasets.load_dataset(LOCAL_FORMATS[local.suffix], data_files=str(local), split="train")
            except Exception as err:  # the builders raise many types; name the file once
                raise DataError(f"data source {path}: cannot be read as {local.suffix[1:]} ({type(err).__name__}: {err})") from err
        if split is not None and not split.startswith("train"):
            raise DataError(f"data source {path}: split {split!r}: a local file holds one split, train (slices such "
                            "as train[:100] or train[10%:] select rows of it; a folder or hub dataset has more splits)")
        return _select(path, split, rows)
    import datasets

    try:
        rows = datasets.load_dataset(path, subset, split=split or "train", revision=revision, data_files=data_files)
    except Exception as err:
        why = "offline mode is set (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE)" if _is_offline() else f"{type(err).__name__}: {err}"
        raise DataError(
            f"data source {path!r} (hub dataset, split {split or 'train'!r}, subset {subset!r}, revision {revision!r}) "
            f"could not be loaded: {why}. To use it offline, download it where the hub is reachable, save it as a "
            f"local .jsonl/.json/.parquet/.csv file or with save_to_disk, and set that as the source's `path`."
        ) from err
    return rows, list(range(len(rows)))


def load_source(
    path: str, split: str | None = None, subset: str | None = None, revision: str | None = None,
    data_files: str | Sequence[str] | Mapping[str, Any] | None = None,
) -> Sequence[Any]:
    """Rows of a local `.jsonl/.json/.parquet/.csv` file, a local folder, or a hub dataset id.

    A folder is a `datasets.save_to_disk` folder (a Dataset or a DatasetDict) or a folder of data
    files laid out as on the hub (splits by file name, or `data_files`). `split` selects a split
    and slices of it everywhere (`train`, `test`, `train[:100]`, `train[10%:20%]`); a local file is
    the split `train`. `subset` (a config name) and `revision` apply to hub ids, `data_files` to
    folders and hub ids.

    Parquet is read with pyarrow (what the training stages read, the reward stage's pairs, needs
    nothing heavier); CSV, folders and hub datasets load through `datasets`, imported only then.
    JSON is parsed row by row so that a row of the wrong shape is reported as a bad row rather
    than as an Arrow schema error.
    """
    return load_rows(path, split, subset, revision, data_files)[0]


def _short(value: Any, limit: int = 48) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def _message_text(message: Mapping[str, Any]) -> str:
    return f"{message.get('role')} {_short(message.get('content'))}"


def _drop_none(value: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in value.items() if v is not None}


def hh_turns(text: str) -> list[dict[str, str]] | None:
    """The turns of Anthropic HH-RLHF text (`\\n\\nHuman: ...\\n\\nAssistant: ...`), or None for other text."""
    if not text.startswith("\n\nHuman:") or "\n\nAssistant:" not in text:
        return None
    parts = _HH_TURN.split(text)
    return [{"role": "user" if who == "Human" else "assistant", "content": body.strip()}
            for who, body in zip(parts[1::2], parts[2::2])]


class _RowChecker:
    """Reads canonical fields of one row, raising `BadRowError` that names source, row and field."""

    def __init__(self, where: str, index: int, row: Mapping[str, Any], columns: Mapping[str, str],
                 user_columns: Mapping[str, str] | None = None, render: str = "chat",
                 roles: Mapping[str, str] | None = None):
        self.where, self.index, self.row, self.columns = where, index, row, columns
        self.user_columns = user_columns or {}
        self.render = render
        self.roles = {**SHAREGPT_ROLES, **(roles or {})}
        self.user_roles = dict(roles or {})

    def column(self, field: str) -> str:
        column = self.columns.get(field, field)
        if self.row.get(column) is None and field not in self.user_columns:
            for alternate in ALTERNATE_COLUMNS.get(field, ()):
                if self.row.get(alternate) is not None:
                    return alternate
        return column

    def bad(self, field: str, problem: str) -> BadRowError:
        column = self.column(field)
        name = field if column == field else f"{field} (column {column!r})"
        return BadRowError(f"{self.where}: row {self.index}: field {name} {problem}")

    def has(self, field: str) -> bool:
        return self.row.get(self.column(field)) is not None

    def get(self, field: str) -> Any:
        value = self.row.get(self.column(field))
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

    def is_text(self, field: str) -> bool:
        return isinstance(self.row.get(self.column(field)), str)

    def messages(self, field: str, default_role: str) -> list[dict[str, Any]]:
        """A string (one turn of `default_role`), one message, or a list of messages (OpenAI or ShareGPT)."""
        value = self.get(field)
        if isinstance(value, str):
            return [{"role": default_role, "content": value}]
        if isinstance(value, Mapping) and ("role" in value or "from" in value):
            value = [value]  # one message (LLaMA-Factory's ShareGPT chosen/rejected)
        if not isinstance(value, list) or not value:
            raise self.bad(field, f"must be a string or a non-empty list of messages, got {type(value).__name__}")
        return [self._message(field, j, message) for j, message in enumerate(value)]

    def _message(self, field: str, j: int, message: Any) -> dict[str, Any]:
        if not isinstance(message, Mapping):
            raise self.bad(field, f"message {j} must be a mapping with role and content, got {type(message).__name__}")
        m = _drop_none(message)
        speaker = None
        if "role" not in m and "from" in m:  # ShareGPT: from/value
            speaker = m.pop("from")
            if not isinstance(speaker, str) or speaker not in self.roles:
                raise self.bad(field, f"message {j} has the ShareGPT speaker {speaker!r} (`from`), which maps to no role; "
                                      f"known: {', '.join(sorted(self.roles))}; map it with the source's `roles`")
            m["role"] = self.roles[speaker]
            if "value" in m:
                m["content"] = m.pop("value")
        elif isinstance(m.get("role"), str) and m["role"] in self.user_roles:
            m["role"] = self.user_roles[m["role"]]
        if not isinstance(m.get("role"), str):
            got = "missing" if m.get("role") is None else type(m["role"]).__name__
            raise self.bad(field, f"message {j} needs a string 'role' ({got})")
        if "function_call" in m:
            raise self.bad(field, f"message {j}: `function_call` (OpenAI's deprecated single-call format) is not "
                                  "supported; give `tool_calls`: [{type: function, function: {name, arguments}}]")
        if speaker == "function_call":  # ShareGPT tool call: the value is {name, arguments} (or a list) as JSON
            m["tool_calls"], m["content"] = m.get("content"), None
            m = _drop_none(m)
        if "tool_calls" in m:
            if m["role"] != "assistant":
                raise self.bad(field, f"message {j}: tool_calls on a {m['role']!r} message; only assistant messages call tools")
            m["tool_calls"] = self._tool_calls(field, j, m["tool_calls"])
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and "tool_calls" in m):
            got = "missing" if content is None else type(content).__name__
            raise self.bad(field, f"message {j} needs a string 'content' ({got})")
        if "reasoning_content" in m and not isinstance(m["reasoning_content"], str):
            raise self.bad(field, f"message {j}: reasoning_content must be a string, "
                                  f"got {type(m['reasoning_content']).__name__}")
        return m

    def _tool_calls(self, field: str, j: int, calls: Any) -> list[dict[str, Any]]:
        """OpenAI tool calls, each as {type: function, function: {name, arguments: object}} (+ id)."""
        where = f"message {j} tool_calls"
        if isinstance(calls, str):
            try:
                calls = json.loads(calls)
            except json.JSONDecodeError as err:
                raise self.bad(field, f"{where} is a string but not JSON ({err.msg})") from err
        if isinstance(calls, Mapping):
            calls = [calls]
        if not isinstance(calls, list) or not calls:
            raise self.bad(field, f"{where} must be a non-empty list of calls, got {type(calls).__name__}")
        out = []
        for k, call in enumerate(calls):
            if not isinstance(call, Mapping):
                raise self.bad(field, f"{where}[{k}] must be a mapping, got {type(call).__name__}")
            call = _drop_none(call)
            if call.get("type", "function") != "function":
                raise self.bad(field, f"{where}[{k}] has type {call['type']!r}; only function calls are supported")
            function = call.get("function", call if "name" in call else None)
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise self.bad(field, f"{where}[{k}] needs function.name (OpenAI's "
                                      "{type: function, function: {name, arguments}})")
            arguments = function.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError as err:
                    raise self.bad(field, f"{where}[{k}] function.arguments is a string but not JSON ({err.msg})") from err
            if not isinstance(arguments, Mapping):
                raise self.bad(field, f"{where}[{k}] function.arguments must be an object, got {type(arguments).__name__}")
            normalized: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": dict(arguments)}}
            if "id" in call:
                normalized["id"] = call["id"]
            out.append(normalized)
        return out

    def tools(self) -> list[dict[str, Any]] | None:
        """The row's tool definitions (a list of JSON schemas, or that list as a JSON string), if it has any."""
        if not self.has("tools"):
            return None
        tools = self.get("tools")
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError as err:
                raise self.bad("tools", f"is a string but not JSON ({err.msg})") from err
        if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
            raise self.bad("tools", f"must be a list of tool schemas, got {type(tools).__name__}")
        for k, tool in enumerate(tools):
            function = tool.get("function", tool)
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise self.bad("tools", f"tool {k} needs a name (function.name)")
        return [dict(t) for t in tools] or None

    def with_system(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.has("system") and messages[0]["role"] != "system":
            return [{"role": "system", "content": self.text("system")}, *messages]
        return messages

    def with_tools(self, row: dict[str, Any]) -> dict[str, Any]:
        tools = self.tools()
        if tools:
            row["tools"] = tools
        return row

    def no_system_in_raw(self) -> None:
        if self.has("system"):
            raise self.bad("system", "applies to chat rows; with render: raw, put the system text into the prompt")

    def raw_text(self, field: str) -> str:
        if not self.is_text(field):
            raise self.bad(field, f"must be a string with render: raw (plain text), got {type(self.get(field)).__name__}; "
                                  "conversations are rendered with the chat template (render: chat)")
        return self.text(field)

    def cut_prompt(self, field: str, prompt: list[dict[str, Any]], side: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A completion conversation without the prompt it repeats at its head (UltraFeedback's chosen/rejected).

        A conversation that starts with an assistant (or tool) message is the completion itself; one that
        starts with any other message must start with the whole prompt.
        """
        n = len(prompt)
        if side[:n] == prompt:
            if len(side) == n:
                raise self.bad(field, "has no message after the prompt it repeats")
            return side[n:]
        if side[0]["role"] in ("assistant", "tool"):
            return side
        k = next(i for i in range(n) if i >= len(side) or side[i] != prompt[i])
        mine = _message_text(side[k]) if k < len(side) else "missing"
        raise self.bad(field, f"does not start with the prompt: its message {k} is {mine}, the prompt's is "
                              f"{_message_text(prompt[k])}")

    def require_assistant(self, field: str, messages: list[dict[str, Any]], after: str = "") -> None:
        if not any(m["role"] == "assistant" for m in messages):
            raise self.bad(field, f"has no assistant message{after}")


def _sft(c: _RowChecker) -> dict[str, Any]:
    if c.has("messages"):
        messages = c.messages("messages", "user")
        if not any(m["role"] == "assistant" for m in messages):
            raise c.bad("messages", "has no assistant message to train on")
        return c.with_tools({"messages": c.with_system(messages)})
    if c.has("text"):  # language modeling, standard form: every token trained
        c.no_system_in_raw()
        return {"prompt": "", "completion": c.text("text")}
    if c.has("prompt") or c.has("completion") or c.has("response"):
        field = "completion" if c.has("completion") and "response" not in c.user_columns else "response"
        if c.render == "raw":
            c.no_system_in_raw()
            return {"prompt": c.raw_text("prompt"), "completion": c.raw_text(field)}
        if not any(isinstance(c.row.get(c.column(f)), (list, Mapping)) for f in ("prompt", field)):
            prompt = [{"role": "user", "content": c.text("prompt")}]  # one user turn, one assistant turn
            completion = [{"role": "assistant", "content": c.text(field)}]
        else:
            prompt = c.messages("prompt", "user")
            completion = c.messages(field, "assistant")
            c.require_assistant(field, completion)
            completion = c.cut_prompt(field, prompt, completion)
        prompt = c.with_system(prompt)
        row = c.with_tools({"messages": prompt + completion})
        if any(m["role"] == "assistant" for m in prompt):  # TRL's completion-only loss: the prompt's turns untrained
            row["completion_start"] = len(prompt)
        return row
    raise c.bad("messages", "is missing (give a messages or conversations column, a text column, or prompt and "
                            "completion/response columns)")


def _common_head(a: Sequence[Any], b: Sequence[Any]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def _raw_preference(c: _RowChecker) -> dict[str, Any]:
    """TRL's standard preference row: strings; the implicit prompt is the common text prefix."""
    c.no_system_in_raw()
    chosen, rejected = c.raw_text("chosen"), c.raw_text("rejected")
    if c.has("prompt"):
        prompt = c.raw_text("prompt")
        if prompt and chosen.startswith(prompt) and rejected.startswith(prompt):  # the prompt repeated in both
            chosen, rejected = chosen[len(prompt):], rejected[len(prompt):]
    else:
        k = _common_head(chosen, rejected)
        if k == 0:
            raise c.bad("prompt", "is missing, and chosen and rejected share no leading text to take as the prompt")
        if k < min(len(chosen), len(rejected)) and chosen[k - 1] == " ":
            k -= 1  # the completions start with their space, as TRL's extract_prompt leaves them
        prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
    for field, text in (("chosen", chosen), ("rejected", rejected)):
        if not text:
            raise c.bad(field, "is empty after the prompt")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _preference(c: _RowChecker) -> dict[str, Any]:
    if c.render == "raw":
        return _raw_preference(c)
    sides: dict[str, list[dict[str, Any]]] = {}
    hh = {f: hh_turns(c.get(f)) if c.is_text(f) else None for f in ("chosen", "rejected")}
    for field in ("chosen", "rejected"):
        sides[field] = hh[field] if hh["chosen"] and hh["rejected"] else c.messages(field, "assistant")
        if not any(m["role"] == "assistant" for m in sides[field]):
            raise c.bad(field, "has no assistant message")
    if c.has("prompt"):
        prompt = hh_turns(c.get("prompt")) if hh["chosen"] and c.is_text("prompt") else None
        if prompt and prompt[-1] == {"role": "assistant", "content": ""}:
            prompt = prompt[:-1]  # HH's trailing "Assistant:" cue
        prompt = prompt or c.messages("prompt", "user")
        if c.is_text("prompt") and all(c.is_text(f) for f in ("chosen", "rejected")) and not hh["chosen"]:
            text, chosen, rejected = c.text("prompt"), c.text("chosen"), c.text("rejected")
            if text and chosen.startswith(text) and rejected.startswith(text):  # the prompt repeated in both
                sides = {"chosen": [{"role": "assistant", "content": chosen[len(text):]}],
                         "rejected": [{"role": "assistant", "content": rejected[len(text):]}]}
        for field in ("chosen", "rejected"):
            sides[field] = c.cut_prompt(field, prompt, sides[field])
    else:  # TRL's implicit prompt: the longest common head of the two conversations
        if all(c.is_text(f) for f in ("chosen", "rejected")) and not hh["chosen"]:
            raise c.bad("prompt", "is missing, and chosen and rejected are plain strings: give a prompt column, "
                                  "conversations, HH-RLHF text, or render: raw for TRL's standard implicit prompt")
        k = _common_head(sides["chosen"], sides["rejected"])
        if k == 0:
            raise c.bad("prompt", "is missing, and chosen and rejected share no leading message to take as the prompt")
        prompt = sides["chosen"][:k]
        sides = {field: side[k:] for field, side in sides.items()}
    for field, side in sides.items():
        c.require_assistant(field, side, " after the prompt")
    return c.with_tools({"prompt": c.with_system(prompt), **sides})


def _unpaired(c: _RowChecker) -> dict[str, Any]:
    label = c.get("label")
    if label not in (True, False) or isinstance(label, float):  # bool, or the ints 1 and 0
        raise c.bad("label", f"must be true/false (or 1/0), got {label!r}")
    if c.render == "raw":
        c.no_system_in_raw()
        return {"prompt": c.raw_text("prompt"), "completion": c.raw_text("completion"), "desirable": bool(label)}
    prompt = c.messages("prompt", "user")
    completion = c.messages("completion", "assistant")
    if not any(m["role"] == "assistant" for m in completion):
        raise c.bad("completion", "has no assistant message")
    completion = c.cut_prompt("completion", prompt, completion)
    c.require_assistant("completion", completion, " after the prompt")
    return c.with_tools({"prompt": c.with_system(prompt), "completion": completion, "desirable": bool(label)})


def unpair(pairs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each preference pair as two unpaired rows: its chosen completion desirable, its rejected one not."""
    out = []
    for pair in pairs:
        for side in ("chosen", "rejected"):
            row = {"prompt": pair["prompt"], "completion": pair[side], "desirable": side == "chosen"}
            if "tools" in pair:
                row["tools"] = pair["tools"]
            out.append(row)
    return out


def _prompt(c: _RowChecker) -> dict[str, Any]:
    prompt = c.get("prompt")
    if c.render == "raw":
        c.no_system_in_raw()
        prompt = c.raw_text("prompt")
    elif not isinstance(prompt, str):  # a message list: validated, kept as given
        prompt = c.with_system(c.messages("prompt", "user"))
    answer = c.text("answer", numbers_ok=True)
    task = c.text("task") if c.has("task") else ""
    row_id = c.text("id", numbers_ok=True) if c.has("id") else f"{c.where}#{c.index}"
    mapped = {c.columns.get(f, f) for f in ("prompt", "answer", "task", "id")}
    example = {k: v for k, v in c.row.items() if k not in mapped}
    example.update({"id": row_id, "task": task, "prompt": prompt, "answer": answer})
    row = c.with_tools({"id": row_id, "task": task, "prompt": prompt, "answer": answer, "example": example})
    if c.render == "raw":
        row["raw"] = True
    return row


_CANONICAL = {"sft": _sft, "preference": _preference, "unpaired": _unpaired, "prompts": _prompt, "eval": _prompt}


def iter_canonical(
    rows: Iterable[Mapping[str, Any]], kind: str, where: str, columns: Mapping[str, str] | None = None,
    skip_bad: bool = False, render: str = "chat", roles: Mapping[str, str] | None = None,
    indices: Sequence[int] | None = None, counter: list[int] | None = None,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number, canonical row) of each good row; bad rows raise, or are counted in `counter[0]`."""
    if kind not in KINDS:
        raise DataError(f"{where}: unknown data kind {kind!r}; kinds: {', '.join(KINDS)}")
    if render not in RENDERS:
        raise DataError(f"{where}: render must be one of {RENDERS}, got {render!r}")
    mapping = {**DEFAULT_COLUMNS[kind], **(columns or {})}
    unknown = sorted(set(columns or {}) - set(DEFAULT_COLUMNS[kind]))
    if unknown:
        raise DataError(f"{where}: columns: unknown field(s) {unknown} for kind {kind!r}; fields: {sorted(DEFAULT_COLUMNS[kind])}")
    for position, row in enumerate(rows):
        index = indices[position] if indices is not None else position
        try:
            if not isinstance(row, Mapping):
                raise BadRowError(f"{where}: row {index}: must be an object of fields, got {type(row).__name__}")
            yield index, _CANONICAL[kind](_RowChecker(where, index, row, mapping, columns, render, roles))
        except BadRowError:
            if not skip_bad:
                raise
            if counter is not None:
                counter[0] += 1


def canonical_rows(
    rows: Iterable[Mapping[str, Any]], kind: str, where: str, columns: Mapping[str, str] | None = None, skip_bad: bool = False,
    render: str = "chat", roles: Mapping[str, str] | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """Map raw rows onto the canonical rows of `kind`; returns (rows, number of bad rows skipped)."""
    counter = [0]
    out = [row for _, row in iter_canonical(rows, kind, where, columns, skip_bad, render, roles, counter=counter)]
    return out, counter[0]


def mix(rows: list[dict[str, Any]], weight: float, max_rows: int | None, key: str) -> list[dict[str, Any]]:
    """One source's share of a mixture: at most `max_rows` rows (a sample drawn by `key`, in data order),
    then `round(weight x n)` rows: each row `floor(weight)` times, plus a sample (by `key`) of the rest."""
    if weight <= 0:
        raise DataError(f"{key}: weight must be above 0, got {weight}")
    if max_rows is not None and len(rows) > max_rows:
        keep = sorted(random.Random(f"{key}/max_rows").sample(range(len(rows)), max_rows))
        rows = [rows[i] for i in keep]
    n = len(rows)
    target = math.floor(weight * n + 0.5)
    if n == 0 or target == n:
        return rows
    copies, extra = divmod(target, n)
    picked = sorted(random.Random(f"{key}/weight").sample(range(n), extra))
    return rows * copies + [rows[i] for i in picked]


SOURCE_KEYS = frozenset({"kind", "path", "split", "subset", "revision", "data_files", "columns", "roles", "render",
                         "weight", "max_rows"})
"""What `source_rows` reads of a `data.sources` entry: the schema's `source` allows exactly these (a test checks)."""


def source_rows(source: Mapping[str, Any], where: str, key: str, skip_bad: bool) -> tuple[list[dict[str, Any]], int]:
    """A config source's canonical rows, each with its `origin` ("<path>: row <i>"), mixed by its
    `weight` and `max_rows` (samples drawn by `key`); and the number of bad rows skipped."""
    path = str(source["path"])
    raw, indices = load_rows(path, source.get("split"), source.get("subset"), source.get("revision"), source.get("data_files"))
    counter = [0]
    rows = []
    for index, row in iter_canonical(raw, source["kind"], path, source.get("columns"), skip_bad, source.get("render", "chat"),
                                     source.get("roles"), indices, counter):
        row[ORIGIN] = f"{path}: row {index}"
        rows.append(row)
    return mix(rows, float(source.get("weight", 1.0)), source.get("max_rows"), key), counter[0]
