"""Each kind of bad model folder gets one clear error naming the tensor or file."""

import json

import pytest
import torch
from safetensors.torch import save_file

from posttrain.model_files import CheckpointError, load_hf_model, resolve_model_source, save_hf_model
from posttrain.models import Transformer

CFG = dict(model_type="qwen2", vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
           num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)


@pytest.fixture
def folder(tmp_path):
    model = Transformer(CFG)
    save_hf_model(model.state_dict(), model.hf_config, tmp_path)
    return tmp_path


def rewrite(folder, edit):
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    edit(state)
    save_file(state, folder / "model.safetensors")


def test_missing_tensor(folder):
    rewrite(folder, lambda s: s.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.0.mlp.up_proj.weight'"):
        load_hf_model(folder)


def test_unexpected_tensor(folder):
    rewrite(folder, lambda s: s.__setitem__("model.layers.7.extra", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model.layers.7.extra'"):
        load_hf_model(folder)


def test_wrong_shape(folder):
    rewrite(folder, lambda s: s.__setitem__("lm_head.weight", torch.zeros(49, 32)))
    with pytest.raises(CheckpointError, match=r"'lm_head.weight' has shape \(49, 32\).*\(50, 32\)"):
        load_hf_model(folder)


def test_truncated_file(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file"):
        load_hf_model(folder)


def test_unknown_model_type(folder):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    with pytest.raises(CheckpointError, match=r"config.json.*unknown model_type 'gpt_neox'"):
        load_hf_model(folder)


def test_remote_code_refused(folder):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoModel": "x.Y"}}))
    with pytest.raises(CheckpointError, match="remote code"):
        load_hf_model(folder)


def test_sliding_window_attention_refused_for_moe(folder):
    """MoE layers are not ported with windows; a Qwen2-MoE config asking for one would train another model."""
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2_moe", "use_sliding_window": True,
                                                    "sliding_window": 64}))
    with pytest.raises(CheckpointError, match="use_sliding_window is not supported for qwen2_moe"):
        load_hf_model(folder)


def test_pickle_checkpoints_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickle checkpoints are refused"):
        load_hf_model(tmp_path)


def test_offline_hub_id_names_the_id(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match=r"'someorg/some-model'.*local folder|'someorg/some-model'.*folder path"):
        resolve_model_source("someorg/some-model")


def test_bf16_save_records_dtype(tmp_path):
    model = Transformer(CFG)
    save_hf_model(model.state_dict(), model.hf_config, tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_hf_model(tmp_path)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16).float())
