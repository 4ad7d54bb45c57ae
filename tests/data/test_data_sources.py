"""Data sources: local formats round trip, column mappings, bad rows, hub ids offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from posttrain.data.sources import BadRowError, DataError, canonical_rows, load_source

FLAT = [
    {"question": "Compute 1 + 2.", "solution": "#### 3", "answer": "3", "task": "arithmetic", "system": "Be brief."},
    {"question": "Reverse: 1, 2", "solution": "#### 2, 1", "answer": "2, 1", "task": "reverse", "system": "Be brief."},
]
CHAT = [
    {"messages": [{"role": "user", "content": "Compute 1 + 2."}, {"role": "assistant", "content": "#### 3"}]},
    {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]},
]
PREF = [{"prompt": "Compute 2 * 3.", "chosen": "#### 6", "rejected": "#### 5"}]


def _write(rows: list[dict], path: Path) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(path)
    else:
        pd.DataFrame(rows).to_csv(path, index=False)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_flat_columns_round_trip_every_format(tmp_path: Path, suffix: str) -> None:
    path = _write(FLAT, tmp_path / f"flat{suffix}")
    rows = load_source(str(path))
    sft, bad = canonical_rows(rows, "sft", str(path), {"prompt": "question", "response": "solution"})
    assert bad == 0
    assert sft == [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": r["question"]},
                      {"role": "assistant", "content": r["solution"]}]}
        for r in FLAT
    ]
    prompts, _ = canonical_rows(rows, "prompts", str(path), {"prompt": "question"})
    assert [(p["prompt"], p["answer"], p["task"]) for p in prompts] == [(r["question"], r["answer"], r["task"]) for r in FLAT]
    assert prompts[0]["id"] == f"{path}#0"  # no id column: source and row
    assert prompts[1]["example"]["solution"] == "#### 2, 1"  # unmapped columns reach the verifier


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_messages_and_preference_round_trip(tmp_path: Path, suffix: str) -> None:
    chat = _write(CHAT, tmp_path / f"chat{suffix}")
    sft, _ = canonical_rows(load_source(str(chat)), "sft", str(chat))
    assert sft == CHAT
    pref = _write(PREF, tmp_path / f"pref{suffix}")
    rows, _ = canonical_rows(load_source(str(pref)), "preference", str(pref))
    assert rows == [{
        "prompt": [{"role": "user", "content": "Compute 2 * 3."}],
        "chosen": [{"role": "assistant", "content": "#### 6"}],
        "rejected": [{"role": "assistant", "content": "#### 5"}],
    }]


def test_csv_numbers_are_answers_not_type_errors(tmp_path: Path) -> None:
    path = tmp_path / "n.csv"
    path.write_text("prompt,answer,id\nCompute 1 + 2.,3,7\nCompute 0.5 + 1.,1.5,8\nCompute 9 + 9.,,9\n")
    rows, skipped = canonical_rows(load_source(str(path)), "eval", str(path), skip_bad=True)
    assert [(r["answer"], r["id"]) for r in rows] == [("3", "7"), ("1.5", "8")] and skipped == 1


BAD_CASES = [
    # (kind, bad row, error fragment)
    ("sft", {"prompt": "Compute 1 + 1."}, "field response is missing"),
    ("sft", {"other": 1}, "field messages is missing"),
    ("sft", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
     "field messages message 1 needs a string 'content' (missing)"),
    ("sft", {"messages": [{"role": "user", "content": "hi"}]}, "field messages has no assistant message"),
    ("sft", {"messages": "not a list but a user turn"}, "field messages has no assistant message"),
    ("sft", {"messages": [["user", "hi"]]}, "field messages message 0 must be a mapping"),
    ("sft", {"messages": 5}, "field messages must be a string or a non-empty list of messages, got int"),
    ("sft", {"prompt": "Compute 1 + 1.", "response": 2}, "field response must be a string, got int"),
    ("preference", {"prompt": "p", "chosen": "#### 1"}, "field rejected is missing"),
    ("preference", {"prompt": "p", "chosen": [{"role": "user", "content": "x"}], "rejected": "r"}, "field chosen has no assistant"),
    ("prompts", {"prompt": "p"}, "field answer is missing"),
    ("prompts", {"prompt": "p", "answer": ["3"]}, "field answer must be a string, got list"),
    ("eval", {"prompt": "p", "answer": "1", "task": 3}, "field task must be a string, got int"),
    ("sft", [1, 2], "must be an object of fields, got list"),
]


@pytest.mark.parametrize("kind,bad,fragment", BAD_CASES)
def test_bad_row_error_names_file_row_and_field(tmp_path: Path, kind: str, bad: dict, fragment: str) -> None:
    good = {"sft": FLAT[0] | {"prompt": "q", "response": "r"}, "preference": PREF[0],
            "prompts": {"prompt": "p", "answer": "1"}, "eval": {"prompt": "p", "answer": "1"}}[kind]
    path = _write([good, good, bad, good], tmp_path / "rows.jsonl")
    with pytest.raises(BadRowError) as err:
        canonical_rows(load_source(str(path)), kind, str(path))
    assert str(err.value).startswith(f"{path}: row 2: ")
    assert fragment in str(err.value)
    rows, skipped = canonical_rows(load_source(str(path)), kind, str(path), skip_bad=True)
    assert (len(rows), skipped) == (3, 1)


def test_mapped_column_is_named_in_errors(tmp_path: Path) -> None:
    path = _write([{"question": "q"}], tmp_path / "m.jsonl")
    with pytest.raises(BadRowError, match=r"row 0: field response \(column 'solution'\) is missing"):
        canonical_rows(load_source(str(path)), "sft", str(path), {"prompt": "question", "response": "solution"})
    with pytest.raises(DataError, match=r"unknown field\(s\) \['answer'\] for kind 'sft'"):
        canonical_rows([], "sft", str(path), {"answer": "x"})


def test_unreadable_local_sources(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file"):
        load_source(str(tmp_path / "missing.jsonl"))
    (tmp_path / "broken.jsonl").write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(DataError, match=r"broken.jsonl: line 2: invalid JSON"):
        load_source(str(tmp_path / "broken.jsonl"))
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(DataError, match="unknown format"):
        load_source(str(tmp_path / "data.txt"))


def test_hub_id_offline_error_names_id_and_local_file_fix(tmp_path: Path) -> None:
    code = (
        "from posttrain.data.sources import load_source, DataError\n"
        "try:\n    load_source('someone/no-such-dataset', split='train', revision='main')\n"
        "except DataError as e:\n    print(e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "'someone/no-such-dataset'" in out
    assert "offline mode is set" in out
    assert "local .jsonl/.json/.parquet/.csv file" in out
