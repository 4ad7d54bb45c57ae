"""The prepare_data stage end to end, its output files, the loaders, and atomic output directories."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
import yaml
from eval_fixtures import run_stage

from posttrain.data.chat import IGNORE_INDEX
from posttrain.data.loader import preference_batches, prompt_batches, sft_batches
from posttrain.data.store import Split, load_split, write_split
from posttrain.tokenizer import Tokenizer, train_bpe_tokenizer
from posttrain.utils.io import atomic_dir
from posttrain.utils.provenance import write_provenance
from posttrain.workflow.schema import validate_config

ROOT = Path(__file__).resolve().parents[2]
STAGE = ROOT / "stages" / "prepare_data.py"
SPLITS = ("sft", "sft_eval", "preference", "prompts", "eval")


def _config(**data: object) -> dict:
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg["data"].update(data)
    cfg.update(stage="prepare_data", key="test-key", upstream={})
    return cfg


def _write_config(cfg: dict, path: Path) -> Path:
    path.write_text(json.dumps(cfg))
    return path


def _run_in_process(cfg: dict, tmp: Path, out: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    config = _write_config(cfg, tmp / f"config-{out.name}.json")
    run_stage("prepare_data", ["--config", config, "--out", out], monkeypatch)
    return out


@pytest.fixture(scope="module")
def default_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stage on the embedded default config (full sizes), run once for this module."""
    tmp = tmp_path_factory.mktemp("default")
    with pytest.MonkeyPatch.context() as mp:
        return _run_in_process(_config(), tmp, tmp / "data", mp)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_gives_byte_identical_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = dict(n_sft=200, n_preference=100, n_prompts=50, n_eval=20)
    # One run through the CLI in a fresh process (its own hash seed), two in this process.
    config = _write_config(_config(**small), tmp_path / "a.json")
    subprocess.run([sys.executable, str(STAGE), "--config", str(config), "--out", str(tmp_path / "a")],
                   check=True, capture_output=True)
    _run_in_process(_config(**small), tmp_path, tmp_path / "b", monkeypatch)
    _run_in_process(_config(**small) | {"seed": 99}, tmp_path, tmp_path / "c", monkeypatch)
    a, b, c = (_files(tmp_path / name) for name in "abc")
    provenance = json.loads(a.pop("posttrain.json"))  # wall time and start time differ by design
    b.pop("posttrain.json")
    for files in (a, b, c):
        files.pop("manifest.json")  # each file's write time, beside its digest
    assert {f"{s}/data-00000-of-00001.arrow" for s in SPLITS} | {"stats.json", "tokenizer/tokenizer.json"} <= set(a)
    assert a == b
    assert c["sft/data-00000-of-00001.arrow"] != a["sft/data-00000-of-00001.arrow"]
    assert (provenance["stage"], provenance["key"], provenance["seed"]) == ("prepare_data", "test-key", 1234)
    assert provenance["config"]["data"]["n_sft"] == 200 and provenance["versions"]["torch"] == torch.__version__


def test_default_output_stats_match_the_files(default_data: Path) -> None:
    stats = json.loads((default_data / "stats.json").read_text())
    tok = Tokenizer(default_data / "tokenizer")
    assert stats["tokenizer"] == {"vocab_size": tok.vocab_size, "pad_id": tok.pad_id, "eos_ids": tok.eos_ids}
    sizes = _config()["data"]
    sft = stats["splits"]["sft"]
    assert sft["documents"] + stats["splits"]["sft_eval"]["documents"] == sizes["n_sft"]
    columns = load_split(default_data, "sft")[:]
    ids, labels = columns["input_ids"], columns["labels"]
    assert ids.shape == (sft["rows"], sizes["max_seq_len"])
    assert (ids != tok.pad_id).sum() == sft["tokens"]
    # One ~35-token document a row at the default 60 positions (training batches are repacked padding-free).
    assert sft["packing_efficiency"] == pytest.approx(sft["tokens"] / ids.size, abs=1e-6)
    assert (labels != IGNORE_INDEX).sum() == sft["loss_tokens"]
    pref = load_split(default_data, "preference")
    assert len(pref) == stats["splits"]["preference"]["rows"] == sizes["n_preference"]
    # Held-out eval problems appear in no training split.
    eval_ids = set(load_split(default_data, "eval")["id"])
    assert len(eval_ids) == sizes["n_eval"] and not eval_ids & set(load_split(default_data, "prompts")["id"])
    eval_prompts = {json.loads(e)["prompt"] for e in load_split(default_data, "eval")["example"]}
    train_text = tok.decode_batch(ids.tolist(), skip_special_tokens=False)
    assert not any(p + "<|im_end|>" in text for p in eval_prompts for text in train_text)


def test_sft_loader_is_deterministic_resumable_and_sharded(default_data: Path) -> None:
    batches = sft_batches(default_data, 64, seed=3)
    per_epoch = len(batches)
    run = [next(batches) for _ in range(per_epoch + 3)]  # crosses an epoch boundary
    assert batches.state_dict() == {"epoch": 1, "index": 3}

    resumed = sft_batches(default_data, 64, seed=3)
    resumed.load_state_dict({"epoch": 0, "index": per_epoch - 2})
    for expected in run[per_epoch - 2 :]:
        got = next(resumed)
        for key in ("input_ids", "labels", "document_ids", "position_ids", "index"):
            assert torch.equal(got[key], expected[key])
    assert not torch.equal(run[0]["index"], run[per_epoch]["index"])  # each epoch has its own order
    assert not torch.equal(run[0]["index"], next(sft_batches(default_data, 64, seed=4))["index"])

    shards = [next(sft_batches(default_data, 64, seed=3, rank=r, world_size=2)) for r in range(2)]
    assert shards[0]["input_ids"].shape == (32, _config()["data"]["max_seq_len"])  # packed rows run to the end
    assert torch.equal(torch.cat([s["index"] for s in shards]), run[0]["index"])
    assert torch.equal(torch.cat([s["input_ids"] for s in shards]), run[0]["input_ids"])

    b = run[0]
    starts = b["position_ids"] == 0
    assert torch.equal(starts[:, 1:], b["document_ids"][:, 1:] != b["document_ids"][:, :-1])
    with pytest.raises(ValueError, match="not divisible"):
        sft_batches(default_data, 63, seed=0, world_size=2)


def test_eval_pass_covers_every_row_once(default_data: Path) -> None:
    n = len(load_split(default_data, "sft_eval"))
    for world in (1, 3):
        seen = [int(i) for r in range(world)
                for batch in sft_batches(default_data, 24, seed=0, split="sft_eval", rank=r, world_size=world,
                                         shuffle=False, loop=False)
                for i in batch["index"]]
        assert sorted(seen) == list(range(n))


def test_preference_and_prompt_batches(default_data: Path) -> None:
    tok = Tokenizer(default_data / "tokenizer")
    batch = next(preference_batches(default_data, 8, seed=0))
    assert batch["chosen_input_ids"].shape == batch["rejected_input_ids"].shape == batch["chosen_labels"].shape
    for side in ("chosen", "rejected"):
        labels = batch[f"{side}_labels"]
        for row in range(8):
            text = tok.decode(labels[row][labels[row] != IGNORE_INDEX].tolist(), skip_special_tokens=False)
            assert text.startswith("#### ") and text.endswith("<|im_end|>")
    pad = batch["chosen_input_ids"] == tok.pad_id
    assert (batch["chosen_labels"][pad] == IGNORE_INDEX).all()

    prompts = next(prompt_batches(default_data, 8, seed=0))
    assert set(prompts) == {"prompt_ids", "answers", "tasks", "examples", "index"}
    assert [e["answer"] for e in prompts["examples"]] == prompts["answers"]
    assert [e["task"] for e in prompts["examples"]] == prompts["tasks"]
    text = tok.decode(prompts["prompt_ids"][0], skip_special_tokens=False)
    assert text == tok.apply_chat_template([{"role": "user", "content": prompts["examples"][0]["prompt"]}],
                                           add_generation_prompt=True)


def test_user_sources_with_folder_tokenizer_and_bad_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    train_bpe_tokenizer([f"Compute {a} + 1. #### {a + 1}" for a in range(200)], 300, model)
    sft = tmp_path / "sft.jsonl"
    rows = [{"prompt": f"Compute {a} + 1.", "response": f"#### {a + 1}"} for a in range(40)]
    rows[7] = {"prompt": "Compute 1 + 1."}
    sft.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = tmp_path / "prompts.csv"
    prompts.write_text("question,answer\nCompute 2 + 2.,4\nCompute 3 + 3.,6\n")
    sources = [{"kind": "sft", "path": str(sft)},
               {"kind": "prompts", "path": str(prompts), "columns": {"prompt": "question"}}]
    # the schema's defaults filled in (`number` reads their answers; `task` needs a task column)
    # (the dry run reads the rows too: with on_bad_row: error it would refuse the config for row 7)
    data = {"sources": sources, "on_bad_row": "skip"}
    sources = validate_config({"data": data, "reward": {"verifiers": ["number"]}})["data"]["sources"]
    cfg = _config(tasks=[], sources=sources, on_bad_row="skip")
    cfg["model"]["policy"] = str(model)
    out = _run_in_process(cfg, tmp_path, tmp_path / "out", monkeypatch)
    stats = json.loads((out / "stats.json").read_text())["splits"]
    assert stats["sft"]["bad_rows_skipped"] == 1
    assert stats["sft"]["documents"] + stats["sft_eval"]["documents"] == 39
    assert stats["prompts"]["rows"] == 2 and stats["eval"]["rows"] == stats["preference"]["rows"] == 0
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()

    cfg["data"]["on_bad_row"] = "error"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:  # a bad row is a known error: one line, exit 1
        _run_in_process(cfg, tmp_path, tmp_path / "out2", monkeypatch)
    assert exited.value.code == 1
    assert capsys.readouterr().err.splitlines()[-1] == f"prepare_data: error: {sft}: row 7: field response is missing"
    assert not list(tmp_path.glob("out2*"))  # nothing half-written


def test_atomic_dir(tmp_path: Path) -> None:
    out = tmp_path / "results" / "stage" / "k1"
    cfg = {"key": "k1", "seed": 0, "upstream": {}}
    with atomic_dir(out) as tmp:
        assert tmp.parent == out.parent and tmp != out and not out.exists()
        (tmp / "file").write_text("first")
        write_provenance(tmp, cfg, "test", 0.0, {"loss": 1.0})
    assert (out / "file").read_text() == "first"
    assert json.loads((out / "posttrain.json").read_text())["metrics"] == {"loss": 1.0}

    with pytest.raises(RuntimeError, match="boom"):
        with atomic_dir(out) as tmp:
            (tmp / "file").write_text("broken")
            raise RuntimeError("boom")
    assert (out / "file").read_text() == "first" and sorted(p.name for p in out.parent.iterdir()) == ["k1"]

    with atomic_dir(out) as tmp:  # the same run (same key) may be redone
        (tmp / "file").write_text("second")
        write_provenance(tmp, cfg, "test", 0.0, {})
    assert (out / "file").read_text() == "second"

    with pytest.raises(FileExistsError, match="holds a different run"):
        with atomic_dir(out) as tmp:
            write_provenance(tmp, copy.deepcopy(cfg) | {"key": "other"}, "test", 0.0, {})
    assert (out / "file").read_text() == "second" and sorted(p.name for p in out.parent.iterdir()) == ["k1"]


def test_split_files_are_memory_mapped_arrow(default_data: Path) -> None:
    before = pa.total_allocated_bytes()
    ds = load_split(default_data, "sft")
    on_disk = sum(f.stat().st_size for f in (default_data / "sft").glob("data-*.arrow"))
    assert ds.table.nbytes > on_disk / 2 and pa.total_allocated_bytes() - before < 4096  # mapped, not read
    row = ds[0]
    assert isinstance(row["input_ids"], np.ndarray) and row["input_ids"].shape == (ds.row_length("input_ids"),)
    rows = ds[np.array([2, 0])]
    assert rows["input_ids"].shape == (2, ds.row_length("input_ids"))
    assert (rows["labels"][1] == row["labels"]).all()


def test_split_reads_ragged_and_text_columns(tmp_path: Path) -> None:
    write_split(tmp_path, "p", {"prompt_ids": [[5, 6, 7], [8], []], "task": ["a", "b", "c"]})
    ds = load_split(tmp_path, "p")
    assert ds.row_length("prompt_ids") is None and len(ds) == 3
    cols = ds[1:]
    assert [c.tolist() for c in cols["prompt_ids"]] == [[8], []] and list(cols["task"]) == ["b", "c"]
    assert ds.select([2, 0])["prompt_ids"][1].tolist() == [5, 6, 7] and ds[0]["task"] == "a"
    assert ds[[]]["prompt_ids"] == [] and Split.from_columns({"task": ["x"]}).to_list() == [{"task": "x"}]
