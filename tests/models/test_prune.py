"""A pruned student: the kept layers of a model folder, renumbered, give the logits of the original
with the other layers removed (checked in transformers), with the tokenizer and a source record;
the angular selection drops the block a model's hidden states pass through unchanged."""

import json

import pytest
import torch
from eval_fixtures import make_data, make_model

from posttrain.model_files import load_hf_model
from posttrain.model_files.hf import CheckpointError
from posttrain.model_files.prune import SOURCE_FILE, angular_layers, kept_layers, main, prune
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


def test_angular_layers_drop_the_closest_block_and_keep_the_last():
    assert angular_layers([0.3, 0.1, 0.2], total=5, drop=2) == [0, 3, 4]
    assert angular_layers([0.2, 0.2, 0.1], total=4, drop=1) == [0, 1, 3]


def _chats(path, n=6):
    rows = [{"messages": [{"role": "user", "content": f"Compute {a} + 30."}, {"role": "assistant", "content": f"#### {a + 30}"}]}
            for a in range(10, 10 + n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_angular_selection_drops_the_layers_that_pass_their_input_through(tmp_path, monkeypatch):
    """Zeroing a block's output projections makes it the identity on the residual stream: its input
    and output hidden states are equal, so the angular choice must drop exactly that block."""
    data = make_data(tmp_path, monkeypatch)
    tok = Tokenizer(data / "tokenizer")
    source = make_model(tmp_path, tok, "sft", "5f75f75f75f7", {"prepare_data": "d0"}, seed=3)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = 6
    (source / "config.json").unlink()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config)).eval()
    for i in (2, 3):  # an identity block in the middle, away from where the evenly spaced choice drops
        model.model.layers[i].self_attn.o_proj.weight.data.zero_()
        model.model.layers[i].mlp.down_proj.weight.data.zero_()
    model.save_pretrained(source)
    calibration = _chats(tmp_path / "calibration.jsonl")

    out = prune(source, tmp_path / "angular", 4, select="angular", calibration=calibration)
    record = json.loads((out / SOURCE_FILE).read_text())
    assert record["layers"] == [0, 1, 4, 5] and record["select"] == "angular"
    assert len(record["block_distances"]) == 4 and record["block_distances"][2] < 1e-6 < min(
        d for i, d in enumerate(record["block_distances"]) if i != 2)
    assert record["calibration_kl"] < 1e-9  # without the identity block, the same next-token distributions
    even = json.loads((prune(source, tmp_path / "even", 4, calibration=calibration) / SOURCE_FILE).read_text())
    assert even["layers"] == [0, 2, 3, 5] and even["calibration_kl"] > 1e-4  # it keeps the identity layers


@pytest.mark.parametrize("content, message", [
    ("", "no rows"),
    ('{"messages": []}\n', "calibration.jsonl:1: a row needs `messages`"),
    ('{"text": "fine"}\nnot json\n', "calibration.jsonl:2: not JSON"),
])
def test_a_bad_calibration_file_names_its_line(tmp_path, capsys, content, message):
    (tmp_path / "calibration.jsonl").write_text(content)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    argv = [str(tmp_path / "model"), "--layers", "2", "--select", "angular", "--calibration",
            str(tmp_path / "calibration.jsonl"), "--out", str(tmp_path / "out")]
    assert main(argv) == 1
    assert message in capsys.readouterr().err and not (tmp_path / "out").exists()
