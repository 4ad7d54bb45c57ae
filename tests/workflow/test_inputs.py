"""What enters a stage key of the files a user brings (posttrain/workflow/inputs.py): content hashes cached by
stat, folders without dot entries, a tokenizer's files only for data prep, hub ids by cached commit, user
code by syntax tree with its local imports, installed packages by version."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import posttrain.workflow.inputs as inputs
from posttrain.workflow.inputs import ContentHashes, code_record, hub_revision, user_inputs


def test_a_file_is_read_once_until_its_stat_changes_and_a_touch_keeps_its_hash(tmp_path, monkeypatch):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n')
    reads = []
    real = inputs.file_sha256
    monkeypatch.setattr(inputs, "file_sha256", lambda p: reads.append(p) or real(p))
    cache = tmp_path / "cache.json"
    first = ContentHashes(cache)
    digest = first.file(path)
    assert first.file(path) == digest and len(reads) == 1
    first.save()
    assert ContentHashes(cache).file(path) == digest and len(reads) == 1  # another planning: a cache hit
    os.utime(path, ns=(1, 1))
    assert ContentHashes(cache).file(path) == digest and len(reads) == 2  # reread, same bytes, same hash
    with path.open("a") as f:
        f.write('{"prompt": "c", "response": "d"}\n')
    assert ContentHashes(cache).file(path) != digest
    cache.write_text("not json")
    assert ContentHashes(cache).file(path) == real(path)  # a damaged cache costs a rehash, never a wrong key


def test_a_folder_hash_covers_names_and_bytes_but_not_dot_entries(tmp_path):
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "sub" / "w.bin").write_bytes(b"\0" * 8)
    hashes = ContentHashes()
    digest, files = hashes.folder(folder)
    assert files == 2
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref")
    (folder / ".DS_Store").write_text("x")
    assert hashes.folder(folder) == (digest, 2)
    (folder / "sub" / "w.bin").rename(folder / "sub" / "v.bin")
    assert hashes.folder(folder)[0] != digest  # a renamed file is another folder


def model_folder(root: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "qwen3"}')
    (root / "model.safetensors").write_bytes(b"weights")
    (root / "tokenizer.json").write_text("{}")
    (root / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    return root


def test_data_prep_keys_only_the_tokenizer_of_a_model_folder(tmp_path):
    folder = model_folder(tmp_path / "policy")
    hashes, presets = ContentHashes(), ("tiny",)
    settings = {"model": {"policy": str(folder), "tokenizer": None}, "data": {"sources": []}}
    data_prep = user_inputs("prepare_data", settings, hashes, presets, [])
    sft = user_inputs("sft", {"model": {"policy": str(folder)}}, hashes, presets, [])
    assert data_prep["model.policy"]["files"] == 2 and sft["model.policy"]["files"] == 4
    (folder / "model.safetensors").write_bytes(b"other weights")
    assert user_inputs("prepare_data", settings, hashes, presets, []) == data_prep
    assert user_inputs("sft", {"model": {"policy": str(folder)}}, hashes, presets, []) != sft
    # With model.tokenizer set, data prep reads that folder's tokenizer, not the policy's.
    other = model_folder(tmp_path / "tok")
    settings["model"]["tokenizer"] = str(other)
    assert list(user_inputs("prepare_data", settings, hashes, presets, [])) == ["model.tokenizer"]
    assert user_inputs("sft", {"model": {"policy": "tiny"}}, hashes, presets, []) == {}  # a preset is our code


def test_policies_sharing_model_tokenizer_share_their_data_preparation(tmp_path):
    """Variants of two policy folders with one `model.tokenizer`: one data preparation (the policy is not read there),
    two SFT runs; without `model.tokenizer`, each policy's own tokenizer makes its own data."""
    from posttrain.workflow.plan import build_plan
    from posttrain.workflow.schema import load_config

    policies = [model_folder(tmp_path / name) for name in ("a", "b")]
    tokenizer = model_folder(tmp_path / "tok")
    (policies[1] / "tokenizer.json").write_text('{"other": 1}')
    table = tmp_path / "families.tsv"
    table.write_text("variant\tmodel.policy\n" + "".join(f"{p.name}\t{p}\n" for p in policies))
    keys = {}
    for shared in (str(tokenizer), None):
        cfg = load_config()
        cfg.update(ablations=str(table), results=str(tmp_path / "results"))
        cfg["model"]["tokenizer"] = shared
        plan = build_plan(cfg)
        keys[shared] = {stage: {v.stages[stage].key for v in plan.variants.values()} for stage in ("prepare_data", "sft")}
    assert len(keys[str(tokenizer)]["prepare_data"]) == 1 and len(keys[str(tokenizer)]["sft"]) == 2, keys
    assert len(keys[None]["prepare_data"]) == 2, keys


def test_hub_ids_enter_by_the_commit_the_cache_resolves(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    refs = tmp_path / "models--org--name" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("a" * 40)
    assert hub_revision("org/name", None, "model")["commit"] == "a" * 40
    assert hub_revision("org/name", "b" * 40, "model")["commit"] == "b" * 40  # a commit is its own revision
    assert hub_revision("org/other", None, "model")["commit"] is None  # unknown to the cache: by name only
    (tmp_path / "datasets--org--rows" / "refs").mkdir(parents=True)
    (tmp_path / "datasets--org--rows" / "refs" / "v1").write_text("c" * 40)
    record = user_inputs("prepare_data", {"model": {"policy": "tiny", "tokenizer": None},
                                          "data": {"sources": [{"path": "org/rows", "revision": "v1"}]}},
                         ContentHashes(), ("tiny",), [])
    assert record["data.sources[0].path"]["commit"] == "c" * 40


def test_user_code_is_keyed_by_its_syntax_and_its_local_imports(tmp_path):
    (tmp_path / "helpers.py").write_text("SCALE = 2\n")
    (tmp_path / "my_reward.py").write_text("import json\nimport helpers\n\n\ndef score(completion, example):\n"
                                           "    return helpers.SCALE * len(completion)\n")
    record = code_record("my_reward", [str(tmp_path)])
    assert sorted(record["modules"]) == ["helpers.py", "my_reward.py"]  # json is no file of the user's
    (tmp_path / "my_reward.py").write_text((tmp_path / "my_reward.py").read_text() + "# a comment\n")
    assert code_record("my_reward", [str(tmp_path)])["code"] == record["code"]
    (tmp_path / "helpers.py").write_text("SCALE = 3\n")
    assert code_record("my_reward", [str(tmp_path)])["code"] != record["code"]
    installed = code_record("yaml", [str(tmp_path)])
    assert "code" not in installed and installed["installed"]["PyYAML"]  # an installed package: by version
    with pytest.raises(LookupError, match="no_such_module"):
        code_record("no_such_module", [str(tmp_path)])
    assert json.loads(json.dumps(record)) == record
