"""Logits parity with transformers for the three families, and HF folder round trips."""

import pytest
import torch

from posttrain.model_files import load_hf_model, save_hf_model
from posttrain.models import Transformer, document_mask, document_positions

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
CONFIGS = {
    "llama-gqa-rope-scaling-tied": dict(
        BASE,
        model_type="llama",
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
    "llama-linear-scaling-bias": dict(
        BASE, model_type="llama", num_key_value_heads=4, rope_scaling={"rope_type": "linear", "factor": 2.0},
        attention_bias=True, mlp_bias=True,
    ),
    "qwen2-mqa-untied": dict(BASE, model_type="qwen2", num_key_value_heads=1, tie_word_embeddings=False),
    "qwen3-gqa-headdim-tied": dict(BASE, model_type="qwen3", num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
}


def hf_model(cfg: dict):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg)).eval()
    with torch.no_grad():  # non-trivial norms and biases so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def ours_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(ids))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_parity_and_round_trips(name, tmp_path):
    hf = hf_model(CONFIGS[name])
    ids = torch.randint(0, 101, (2, 300 if "rope" in name else 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits

    # HF -> ours through an HF folder written by transformers.
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf_model(tmp_path / "hf")
    assert (ours_logits(ours, ids) - ref).abs().max().item() <= 1e-4

    # ours -> HF through our writer (sharded to exercise the index).
    save_hf_model(ours.state_dict(), ours.hf_config, tmp_path / "ours", max_shard_bytes=50_000)
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert (back(ids).logits - ref).abs().max().item() <= 1e-4
    assert (ours_logits(load_hf_model(tmp_path / "ours"), ids) - ref).abs().max().item() <= 1e-4


def test_meta_build_materializes_like_eager():
    cfg = dict(CONFIGS["qwen3-gqa-headdim-tied"])
    with torch.device("meta"):
        meta = Transformer(cfg)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.tie_weights()
    torch.manual_seed(3)
    meta.init_weights()
    torch.manual_seed(3)
    eager = Transformer(cfg)
    ids = torch.randint(0, 101, (1, 12))
    assert torch.equal(ours_logits(meta, ids), ours_logits(eager, ids))
    assert meta.lm_head.weight is meta.model.embed_tokens.weight


def test_packed_documents_do_not_see_each_other():
    torch.manual_seed(0)
    model = Transformer(CONFIGS["qwen3-gqa-headdim-tied"]).eval()
    docs = [torch.randint(0, 101, (n,)) for n in (5, 9, 6)]
    packed = torch.cat(docs)[None]
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        hidden = model(packed, document_ids=doc_ids)
        start = 0
        for d in docs:  # each document alone, from position 0, gives the same states
            alone = model(d[None])
            assert torch.allclose(hidden[0, start : start + len(d)], alone[0], atol=1e-5)
            start += len(d)
    assert document_positions(doc_ids)[0].tolist() == list(range(5)) + list(range(9)) + list(range(6))
    mask = document_mask(doc_ids)[0, 0]
    assert not mask[5:14, :5].any() and not mask[14:, :14].any()
