"""Native ports against transformers' modeling code: Mistral, OLMo 2, SmolLM3, Gemma 3 (text), Phi-3.

Each family on a tiny random float32 config, a sliding window shorter than the sequence where the
family has one. transformers builds the model and writes the folder (config.json, safetensors); ours
loads that folder. Checked: logits, the gradient of every weight under a next-token loss, packed rows
(two documents in one row) against each document alone, greedy KV-cache generation of ragged
(left-padded) prompts against transformers' `generate`, and the dry run's model check. Tolerances:
logits 1e-5 absolute; gradients 1e-5 of the largest entry of each (measured differences are printed
with -s and quoted in docs/models.md).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hf_testing import NATIVE_BASE as BASE, NATIVE_FAMILIES as FAMILIES, NATIVE_VOCAB as VOCAB, NATIVE_WINDOW as WINDOW, hf_greedy
from posttrain.generation.sampler import SamplingParams, generate
from posttrain.model_files import load_hf_model
from posttrain.models import ModelArgs, ModelConfigError, Transformer
from posttrain.workflow.preflight import model_source_problem

transformers = pytest.importorskip("transformers")

FWD_ATOL = 1e-5
GRAD_RTOL = 1e-5


def hf_model(cfg: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg)).eval()
    with torch.no_grad():  # non-trivial norms and biases so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    """(name, transformers' model, ours loaded from the folder transformers wrote, that folder)."""
    name = request.param
    hf = hf_model(FAMILIES[name])
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder)
    return name, hf, load_hf_model(folder).eval(), folder


def ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_logits(pair):
    name, hf, ours, _ = pair
    x = ids(2, 24)
    with torch.no_grad():
        diff = (ours.logits(ours(x)) - hf(x).logits).abs().max().item()
    print(f"\n{name}: forward max|diff| {diff:.2e}")
    assert diff <= FWD_ATOL
    if ours.args.sliding_layers:  # the window decides: without it the logits are another model's
        ours.args = dataclasses.replace(args := ours.args, sliding_layers=())
        with torch.no_grad():
            assert (ours.logits(ours(x)) - hf(x).logits).abs().max().item() > 1e-3
        ours.args = args


def test_gradients(pair):
    name, hf, ours, _ = pair
    x = ids(2, 24, seed=2)

    def grads(model: torch.nn.Module, logits_of) -> dict[str, torch.Tensor]:
        model.zero_grad()
        logits = logits_of(x)
        F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    theirs = grads(hf, lambda t: hf(t).logits)
    mine = grads(ours, lambda t: ours.logits(ours(t)))
    assert set(mine) == set(theirs)
    worst = max(((mine[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() for n, g in theirs.items())
    print(f"\n{name}: gradient max|diff| / max|grad| {worst:.2e}")
    assert worst <= GRAD_RTOL


def test_packed_rows_match_each_document_alone(pair):
    """Document-causal and within the window: each document as if run by itself from position 0."""
    _, hf, ours, _ = pair
    docs = [ids(1, 11, seed=3)[0], ids(1, 13, seed=4)[0]]
    packed = torch.cat(docs)[None]
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        logits = ours.logits(ours(packed, document_ids=doc_ids))[0]
        alone = torch.cat([hf(d[None]).logits[0] for d in docs])
    assert (logits - alone).abs().max().item() <= FWD_ATOL


def test_greedy_generation_matches_transformers(pair):
    """Ragged prompts, left-padded, decoded past the window from the KV cache."""
    _, hf, ours, _ = pair
    prompts = [ids(1, 9, seed=5)[0].tolist(), ids(1, 5, seed=6)[0].tolist()]
    new = 8
    out = generate(ours, prompts, SamplingParams(max_new_tokens=new, temperature=0.0), pad_id=0)
    assert out.tokens == hf_greedy(hf, prompts, new)


def test_dry_run_accepts_the_folder(pair):
    _, _, _, folder = pair
    assert model_source_problem(str(folder)) is None


def test_window_follows_transformers_rule():
    """Query q sees key k when 0 <= q - k < sliding_window: a window of 1 is the token itself."""
    from posttrain.models.attention import window_band

    band = window_band(4, 6, 3, torch.device("cpu"))  # queries at cache indices 2..5
    assert band.int().tolist() == [[1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    qwen = ModelArgs.from_hf(FAMILIES["qwen2-sliding"])
    assert (qwen.sliding_window, qwen.sliding_layers) == (WINDOW, (1, 2))
    assert ModelArgs.from_hf({**FAMILIES["qwen2-sliding"], "use_sliding_window": False}).sliding_layers == ()


def test_moe_sliding_window_refused():
    cfg = dict(BASE, model_type="qwen3_moe", use_sliding_window=True, sliding_window=WINDOW)
    with pytest.raises(ModelConfigError, match="use_sliding_window is not supported for qwen3_moe"):
        ModelArgs.from_hf(cfg)


def ours_from(hf: torch.nn.Module) -> Transformer:
    """Ours from transformers' config.json dict and weights, without a folder."""
    model = Transformer(hf.config.to_dict())
    model.load_state_dict(hf.state_dict(), strict=False)  # tied models' state dicts may omit lm_head
    model.tie_weights()
    return model.eval()


def test_gemma3_reads_4x_and_5x_rope_keys_alike():
    """config.json of transformers 4.x (rope_theta, rope_local_base_freq, rope_scaling) or 5.x (rope_parameters
    per layer type) give the same model."""
    old = FAMILIES["gemma3_text"]
    new = transformers.AutoConfig.for_model(**old).to_dict()
    assert "rope_parameters" in new and "rope_parameters" not in old
    args = ModelArgs.from_hf(new)
    assert ModelArgs.from_hf(old) == args
    assert (args.rope_theta, args.local_rope_theta, args.sliding_layers) == (100_000.0, 10_000.0, (0, 2))
    assert args.rope_scaling["factor"] == 2.0
    assert args.embed_scale == 64**0.5 and args.attn_scale == 24**-0.5


@pytest.mark.parametrize("key", ["final_logit_softcapping", "attn_logit_softcapping"])
def test_gemma3_soft_capping_refused(key):
    with pytest.raises(ModelConfigError, match=f"x.json: {key}=30.0 is not supported"):
        ModelArgs.from_hf({**FAMILIES["gemma3_text"], key: 30.0}, source="x.json")
    assert ModelArgs.from_hf({**FAMILIES["gemma3_text"], key: None}).model_type == "gemma3_text"


def test_phi3_longrope_refused():
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                "original_max_position_embeddings": 64}
    with pytest.raises(ModelConfigError, match="x.json: rope scaling type 'longrope'.*not supported"):
        ModelArgs.from_hf({**FAMILIES["phi3"], "rope_scaling": longrope}, source="x.json")


class _Mesh:
    def size(self) -> int:
        return 2


@pytest.mark.parametrize("name,reason", [("phi3", "fused qkv_proj"), ("olmo2", "spans all heads"),
                                         ("gemma3_text", "norms after attention")])
def test_tensor_parallel_refused_where_the_plan_cannot_shard(name, reason):
    from posttrain.parallel.parallelize import apply_tensor_parallel, unshardable_layout

    with pytest.raises(ModelConfigError, match=f"parallel.tp=2: .* {name}: .*{reason}"):
        apply_tensor_parallel(Transformer({**FAMILIES[name], "vocab_size": 102}), _Mesh())
    assert unshardable_layout(ModelArgs.from_hf(FAMILIES["mistral"])) is None
    assert unshardable_layout(ModelArgs.from_hf(FAMILIES["smollm3"])) is None


def test_phi3_lora_default_targets_take_the_fused_modules():
    """The default targets (q/k/v/o/gate/up/down) adapt qkv_proj and gate_up_proj whole; the merge keeps HF names."""
    import copy

    from posttrain.models.lora import apply_lora, lora_modules, merged_state_dict

    hf = hf_model(FAMILIES["phi3"])
    ours = ours_from(hf)
    model = apply_lora(copy.deepcopy(ours), rank=2, alpha=4)
    assert model.lora_config.targets == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert {n.rsplit(".", 1)[-1] for n, _ in lora_modules(model)} == set(model.lora_config.targets)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_B.weight.normal_()
        x = ids(1, 12)
        merged = merged_state_dict(model)
        hf_merged = copy.deepcopy(hf)
        hf_merged.load_state_dict(merged, strict=False)
        assert set(merged) >= set(hf.state_dict()) - {"lm_head.weight"}
        assert (model.logits(model(x)) - hf_merged(x).logits).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match="lora.targets: q_proj alone cannot take an adapter in phi3"):
        apply_lora(copy.deepcopy(ours), rank=2, alpha=4, targets=("q_proj", "o_proj"))


def test_pruning_keeps_each_kept_layers_rope_and_window(tmp_path):
    """SmolLM3's no_rope_layers and layer_types have an entry per layer: a pruned student keeps its layers'."""
    from posttrain.model_files.prune import prune

    hf = hf_model(FAMILIES["smollm3"])  # rope, none, rope, none
    hf.save_pretrained(tmp_path / "src")
    prune(tmp_path / "src", tmp_path / "out", 2)  # layers 0 and 3
    student = load_hf_model(tmp_path / "out")
    assert student.layer_rope == ["global", None]
