"""A pruned student: the kept layers of a model folder, renumbered, give the logits of the original
with the other layers removed (checked in transformers), with the tokenizer and a source record."""

import json

import pytest
import torch
from eval_fixtures import make_data, make_model

from posttrain.model_files import load_hf_model
from posttrain.model_files.hf import CheckpointError
from posttrain.model_files.prune import SOURCE_FILE, kept_layers, main, prune
from posttrain.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


def test_kept_layers_are_evenly_spaced_with_both_ends():
    assert kept_layers(30, 8) == [0, 4, 8, 12, 17, 21, 25, 29]
    assert kept_layers(4, 2) == [0, 3] and kept_layers(4, 4) == [0, 1, 2, 3] and kept_layers(5, 1) == [0]
    with pytest.raises(CheckpointError, match="between 1 and the model's 4 layers, got 5"):
        kept_layers(4, 5)


def test_the_pruned_folder_is_the_source_without_the_dropped_layers(tmp_path, monkeypatch):
    data = make_data(tmp_path, monkeypatch)
    tok = Tokenizer(data / "tokenizer")
    source = make_model(tmp_path, tok, "sft", "5f75f75f75f7", {"prepare_data": "d0"}, seed=3)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = 4
    (source / "config.json").unlink()
    full = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(full).eval()  # 4 random layers
    reference.save_pretrained(source)

    out = prune(source, tmp_path / "pruned", 2)
    record = json.loads((out / SOURCE_FILE).read_text())
    assert record["layers"] == [0, 3] and record["source_layers"] == 4 and len(record["weights_sha256"]) == 1
    assert Tokenizer(out).vocab_size == tok.vocab_size
    assert not (out / "posttrain.json").exists()  # the source's stage record describes another folder
    reference.model.layers = torch.nn.ModuleList([reference.model.layers[0], reference.model.layers[3]])
    reference.config.num_hidden_layers = 2
    pruned = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours = load_hf_model(out).eval()
    ids = torch.tensor([tok.encode("Compute 12 + 30.")])
    with torch.no_grad():
        expected = reference(ids, use_cache=False).logits
        assert torch.equal(pruned(ids, use_cache=False).logits, expected)
        torch.testing.assert_close(ours.lm_head(ours(ids)), expected, rtol=1e-5, atol=1e-5)


def test_a_missing_folder_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), "--layers", "2", "--out", str(tmp_path / "out")]) == 1
    assert "nope" in capsys.readouterr().err and not (tmp_path / "out").exists()
