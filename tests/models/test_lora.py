"""LoRA / QLoRA: merged export equals the adapter forward, QLoRA trains on NF4, PEFT layout, switches."""

import json

import pytest
import torch
from safetensors.torch import load_file

from posttrain.losses.ce import linear_cross_entropy
from posttrain.models import Transformer
from posttrain.models.lora import (
    LoRALinear,
    apply_lora,
    disable_adapters,
    lora_modules,
    merged_state_dict,
    save_peft_adapter,
)
from posttrain.optim import build_optimizer
from posttrain.parallel import load_full_state_dict, materialize

# Every projection has a multiple of 16384 elements: NF4 quantizes in blocks of 64 x 256.
TINY = {
    "model_type": "qwen3", "vocab_size": 128, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True, "initializer_range": 0.02,
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(TINY)


def randomize_adapters(model: torch.nn.Module) -> None:
    """Fresh adapters are a no-op (B = 0); give B values so merging has something to fold in."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.05)


@pytest.fixture(scope="module")
def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)


def test_fresh_adapter_is_identity_and_only_adapters_train(tokens):
    base = make_model()
    model = apply_lora(make_model(), rank=4, alpha=8, targets=TARGETS)
    x, _ = tokens
    torch.testing.assert_close(model(x), base(x), rtol=0, atol=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(TARGETS) * TINY["num_hidden_layers"]
    # HF names of the base weights are unchanged.
    assert "model.layers.1.mlp.down_proj.weight" in model.state_dict()


@pytest.mark.parametrize("quantize", [False, True], ids=["lora", "qlora"])
def test_merged_state_dict_equals_adapter_forward(tokens, quantize):
    model = apply_lora(make_model(), rank=4, alpha=8, targets=TARGETS, quantize_base=quantize)
    randomize_adapters(model)
    x, _ = tokens
    with torch.no_grad():
        adapter_out = model(x)
        merged = merged_state_dict(model)
        assert not any("lora_" in k for k in merged)
        assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in merged.values())
        plain = Transformer(TINY)
        load_full_state_dict(plain, merged)
        merged_out = plain(x)
    torch.testing.assert_close(merged_out, adapter_out, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), disable_adapters(model):
        base_out = model(x)
    assert (base_out - adapter_out).abs().max() > 1e-3  # the adapters do change the output
    assert not any(m.disabled for _, m in lora_modules(model))  # restored after the block


def test_disable_adapters_gives_the_base_model(tokens):
    base = make_model()
    model = apply_lora(make_model(), rank=4, alpha=8, targets=("q_proj", "v_proj"))
    randomize_adapters(model)
    x, _ = tokens
    with torch.no_grad(), disable_adapters(model):
        torch.testing.assert_close(model(x), base(x), rtol=0, atol=0)


def test_qlora_trains_with_nf4_base_weights(tokens):
    from torchao.quantization import NF4Tensor

    model = apply_lora(make_model(), rank=8, alpha=16, targets=TARGETS, quantize_base=True)
    q_proj = model.model.layers["0"].self_attn.q_proj
    assert isinstance(q_proj, LoRALinear) and isinstance(q_proj.weight, NF4Tensor)
    frozen = q_proj.weight.get_original_weight().clone()
    opt = build_optimizer(model, 1e-2, 0.0, {})
    x, y = tokens
    losses = []
    for _ in range(8):
        loss = linear_cross_entropy(model(x), model.lm_head, y, num_chunks=2)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    assert isinstance(q_proj.weight, NF4Tensor)
    assert torch.equal(q_proj.weight.get_original_weight(), frozen)  # the base never moves


def test_peft_adapter_export(tmp_path):
    model = apply_lora(make_model(), rank=4, alpha=8, dropout=0.05, targets=("q_proj", "down_proj"))
    randomize_adapters(model)
    out = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path="../sft")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert (cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"]) == (4, 8.0, 0.05)
    assert cfg["target_modules"] == ["down_proj", "q_proj"]
    tensors = load_file(out / "adapter_model.safetensors")
    assert len(tensors) == 2 * 2 * TINY["num_hidden_layers"]
    a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert a.shape == (4, 128) and b.shape == (4 * 64, 4)
    torch.testing.assert_close(b, model.model.layers["0"].self_attn.q_proj.lora_B.weight.detach())
    assert not list(out.glob("*.tmp"))


def test_meta_build_initializes_adapters_and_loads_base_weights(tokens):
    source = make_model()
    with torch.device("meta"):
        model = apply_lora(Transformer(TINY), rank=4, alpha=8, targets=TARGETS)
    materialize(model, "cpu", init=False)
    load_full_state_dict(model, {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"})
    for _, m in lora_modules(model):
        assert torch.count_nonzero(m.lora_B.weight) == 0 and torch.count_nonzero(m.lora_A.weight) > 0
    x, _ = tokens
    torch.testing.assert_close(model(x), source(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="missing"):
        load_full_state_dict(model, {"model.norm.weight": torch.ones(128)})


def test_bad_targets_are_refused():
    with pytest.raises(ValueError, match="lora.targets"):
        apply_lora(make_model(), rank=4, alpha=8, targets=("q_proj", "qkv"))
    with pytest.raises(ValueError, match="tied"):
        apply_lora(make_model(), rank=4, alpha=8, targets=("lm_head",))
    with torch.device("meta"), pytest.raises(ValueError, match="QLoRA"):
        apply_lora(Transformer(TINY), rank=4, alpha=8, targets=("q_proj",), quantize_base=True)


def test_peft_loads_the_exported_adapter(tmp_path, tokens):
    """The export loads with `peft.PeftModel` on a transformers Qwen3 and gives our logits and merge."""
    peft = pytest.importorskip("peft", reason="peft is a benchmark extra, absent from the runtime environment")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, max_position_embeddings=64)).eval()
    ours = Transformer(TINY)
    load_full_state_dict(ours, hf.state_dict())
    apply_lora(ours, rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    randomize_adapters(ours)
    save_peft_adapter(ours, tmp_path)
    peft_model = peft.PeftModel.from_pretrained(hf, str(tmp_path)).eval()
    x, _ = tokens
    with torch.no_grad():
        torch.testing.assert_close(peft_model(x).logits, ours.logits(ours(x)), rtol=1e-4, atol=1e-4)
        peft_merged = peft_model.merge_and_unload().state_dict()
    for name, weight in merged_state_dict(ours).items():
        if name in peft_merged:
            torch.testing.assert_close(peft_merged[name], weight, rtol=1e-5, atol=1e-6, msg=name)
