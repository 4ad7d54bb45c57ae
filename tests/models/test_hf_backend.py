"""The transformers backend (`model.backend`): families without a native port on transformers' own model code.

Tiny random GPT-NeoX, Starcoder2 and Granite (logits_scaling) models: our hidden states through our head
give transformers' logits, packed rows attend per document, greedy decoding matches `generate`, the SFT
stage trains them and writes folders transformers loads, and the dry run accepts them but not
`backend: native`. Bloom (no position_ids) covers packed rows by padding.
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_testing import hf_greedy, left_padded
from posttrain.generation.sampler import SamplingParams, generate
from posttrain.model_files import CheckpointError, load_hf_model
from posttrain.models.args import ModelConfigError, model_backend
from posttrain.models.hf_backend import HFCausalLM
from posttrain.parallel import parallelize
from posttrain.workflow.preflight import model_source_problem

transformers = pytest.importorskip("transformers")

VOCAB = 512  # above the tiny preset's tokenizer, which the SFT data is prepared with
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    "gpt_neox": dict(SMALL, hidden_dropout=0.0, attention_dropout=0.0),
    "starcoder2": dict(SMALL, num_key_value_heads=2, residual_dropout=0.0, embedding_dropout=0.0),
    "granite": dict(SMALL, num_key_value_heads=2, logits_scaling=3.0, embedding_multiplier=2.0,
                    residual_multiplier=0.5, attention_multiplier=0.3),
}
LOGITS_ATOL = 1e-5


def save_family(name: str, folder, **overrides) -> transformers.PreTrainedModel:
    """A random model of the family, saved as transformers saves it (norms and biases away from their init)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(name, **{**FAMILIES.get(name, SMALL), **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name or param_name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    return model


@pytest.fixture(params=sorted(FAMILIES), scope="module")
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_family(request.param, folder)
    return request.param, hf, load_hf_model(folder, backend="auto").eval(), folder


def ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_hidden_states_through_our_head_are_transformers_logits(family):
    name, hf, ours, _ = family
    assert isinstance(ours, HFCausalLM)
    tokens = ids(2, 17, seed=1)
    with torch.no_grad():
        diff = (ours.lm_head(ours(tokens)) - hf(tokens).logits).abs().max().item()
    print(f"\n{name}: logits max|diff| {diff:.2e}")
    assert diff <= LOGITS_ATOL


def test_names_are_the_checkpoints(family):
    _, hf, ours, _ = family
    assert set(ours.state_dict()) == set(hf.state_dict())


def test_packed_rows_match_each_document_alone(family):
    _, hf, ours, _ = family
    docs = [ids(1, 7, seed=3)[0], ids(1, 10, seed=4)[0]]
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        packed = ours.lm_head(ours(torch.cat(docs)[None], document_ids=doc_ids))[0]
        alone = torch.cat([hf(d[None]).logits[0] for d in docs])
    assert ours.packing == "positions"
    assert (packed - alone).abs().max().item() <= LOGITS_ATOL


def test_a_model_without_position_ids_packs_by_padding(tmp_path):
    hf = save_family("bloom", tmp_path, n_embed=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0)
    ours = load_hf_model(tmp_path, backend="transformers").eval()
    docs = [ids(1, 5, seed=5)[0], ids(1, 9, seed=6)[0], ids(1, 4, seed=7)[0]]
    rows = torch.stack([torch.cat(docs[:2]), torch.cat([docs[2], docs[1], docs[2][:1]])])
    doc_ids = torch.tensor([[0] * 5 + [1] * 9, [0] * 4 + [1] * 9 + [2]])
    with torch.no_grad():
        packed = ours.lm_head(ours(rows, document_ids=doc_ids))
        alone = [torch.cat([hf(d[None]).logits[0] for d in parts]) for parts in
                 ([docs[0], docs[1]], [docs[2], docs[1], docs[2][:1]])]
    assert ours.packing == "padding"
    assert (packed - torch.stack(alone)).abs().max().item() <= LOGITS_ATOL


def test_greedy_generation_matches_transformers(family):
    """Ragged prompts, left-padded, decoded through transformers' own KV cache."""
    _, hf, ours, _ = family
    prompts = [ids(1, 9, seed=8)[0].tolist(), ids(1, 5, seed=9)[0].tolist()]
    new = 6
    out = generate(ours, prompts, SamplingParams(max_new_tokens=new, temperature=0.0), pad_id=0)
    ref = hf_greedy(hf, prompts, new)
    assert out.tokens == ref
    padded, attention = left_padded(prompts)
    with torch.no_grad():
        first = torch.log_softmax(hf(padded, attention_mask=attention).logits[:, -1].float(), -1)
    expected = first.gather(-1, torch.tensor([[r[0]] for r in ref])).squeeze(-1)
    assert torch.allclose(torch.tensor([lp[0] for lp in out.logprobs]), expected, atol=1e-5)


def test_backend_choice_and_refusals(family):
    name, _, ours, folder = family
    config = json.loads((folder / "config.json").read_text())
    assert model_backend(config, "auto") == model_backend(config, "transformers") == "transformers"
    assert model_backend({"model_type": "llama"}, "auto") == "native"
    with pytest.raises(ModelConfigError, match="model.backend"):
        model_backend(config, "native")
    with pytest.raises(ModelConfigError, match="remote code"):
        model_backend({**config, "auto_map": {"AutoModelForCausalLM": "x.Y"}}, "auto")
    with pytest.raises(ModelConfigError, match="neither ported nor a causal LM"):
        model_backend({"model_type": "no_such_family"}, "auto")
    with pytest.raises(CheckpointError, match="unknown model_type"):  # the native loader, as before
        load_hf_model(folder)
    for key in ("tp", "cp", "ep"):
        with pytest.raises(ModelConfigError, match=f"parallel.{key}=2: the transformers backend"):
            parallelize(ours, None, {}, {key: 2})


def test_dry_run_accepts_the_folder_and_refuses_native(family):
    name, _, _, folder = family
    assert model_source_problem(str(folder)) is None
    assert model_source_problem(str(folder), backend="transformers") is None
    why = model_source_problem(str(folder), backend="native")
    assert f"model_type {name!r} has no native port" in why and "model.backend" in why


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_sft_trains_the_family_and_writes_a_folder_transformers_loads(name, tmp_path):
    """The SFT stage script from a saved folder: the loss falls, the output is the family's own HF folder with
    the trained weights, and posttrain.json says which backend ran it."""
    from sft_testing import metrics, prepare_data, resolved_config, run_sft, train_losses, weights

    folder = tmp_path / "base"
    save_family(name, folder)
    data = prepare_data(tmp_path, {"n_sft": 120})
    sft = {"steps": 6, "batch_size": 8, "lr": 3e-3, "warmup_steps": 1, "checkpoint_every": 1000, "log_every": 1}
    cfg = resolved_config("sft", f"hf-{name}", sft=sft, model={"policy": str(folder)},
                          memory={"activation_checkpointing": 1})
    proc = run_sft(cfg, data, tmp_path / "out")
    assert "packed rows run as per-document position ids" in proc.stderr
    losses = train_losses(metrics(tmp_path / "out"))
    summary = json.loads((tmp_path / "out" / "posttrain.json").read_text())
    assert summary["metrics"]["model_backend"] == "transformers", summary
    assert summary["metrics"]["eval_loss_after"] < summary["metrics"]["eval_loss_before"], summary
    assert losses[-1] < losses[0], losses
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    loaded.save_pretrained(tmp_path / "resaved")  # under the checkpoint names, as the stage writes them
    written, resaved = weights(tmp_path / "out"), weights(tmp_path / "resaved")
    assert set(written) == set(resaved) and all(torch.equal(resaved[k], v) for k, v in written.items())
    before = weights(folder)
    assert any(not torch.equal(before[k], v) for k, v in written.items())
