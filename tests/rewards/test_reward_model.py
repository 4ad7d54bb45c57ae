"""Reward model parts: Bradley-Terry loss vs its formula, the HF sequence-classification export
against transformers (every native family; GPT-2 on the transformers backend), starting from a causal LM
folder, and where the score is read."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.model_files import CheckpointError, save_hf_model
from posttrain.losses.bradley_terry import bradley_terry_loss
from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.models import SUPPORTED_MODEL_TYPES, Transformer
from posttrain.models.families import FAMILIES
from posttrain.rewards import (
    HFRewardModel,
    RewardModel,
    load_reward_model,
    pad_right,
    save_reward_model,
    score_sequences,
    scored_lengths,
)
from posttrain.rules import reward_model_backend_problem

VOCAB_GPT2 = 512  # hf_testing's tiny transformers-only families
CFG = dict(model_type="qwen3", vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
           pad_token_id=0, eos_token_id=100)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and OpenMP spin-waits on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sequences(n: int = 7, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 101, (int(k),), generator=g).tolist() for k in torch.randint(1, 20, (n,), generator=g)]


@pytest.mark.parametrize("margin", [0.0, 0.5, "per_pair"])
def test_bradley_terry_loss_matches_the_formula(margin):
    g = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(9, generator=g, requires_grad=True), torch.randn(9, generator=g)
    m = torch.rand(9, generator=g) if margin == "per_pair" else margin
    loss, metrics = bradley_terry_loss(chosen, rejected, m)
    gap = chosen.detach().double() - rejected.double() - torch.as_tensor(m, dtype=torch.float64)
    expected = -torch.log(1 / (1 + torch.exp(-gap))).mean()
    assert abs(loss.item() - expected.item()) <= 1e-6
    assert metrics["accuracy"].item() == pytest.approx((chosen > rejected).float().mean().item())
    assert metrics["margin"].item() == pytest.approx((chosen - rejected).mean().item(), abs=1e-6)
    loss.backward()  # d/dr_c of -log sigma(gap) = -(1 - sigma(gap)) / n
    assert torch.allclose(chosen.grad.double(), -(1 - torch.sigmoid(gap)) / 9, atol=1e-6)
    with pytest.raises(ValueError, match="differ in shape"):
        bradley_terry_loss(chosen, rejected[:3])


def test_export_loads_in_transformers_with_the_same_scores(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = RewardModel(CFG).eval()
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores of order 1, so 1e-4 is a real bound
    save_reward_model(model, tmp_path, pad_token_id=0)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["architectures"], config["num_labels"], config["pad_token_id"]) == (["Qwen3ForSequenceClassification"], 1, 0)

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert set(hf.state_dict()) == set(model.state_dict())
    ids, lengths = pad_right(sequences(), pad_id=0)
    with torch.no_grad():
        expected = hf(ids, attention_mask=(ids != 0).long()).logits.squeeze(-1)
    ours = torch.tensor(score_sequences(model, sequences(), pad_id=0, batch_size=3))
    assert expected.abs().max().item() > 0.1
    assert (ours - expected).abs().max().item() <= 1e-4
    reloaded = torch.tensor(score_sequences(load_reward_model(tmp_path), sequences(), pad_id=0))
    assert torch.allclose(reloaded, ours, atol=1e-5)


def test_reward_model_from_a_causal_lm_folder_keeps_its_decoder(tmp_path):
    torch.manual_seed(0)
    policy = Transformer({**CFG, "tie_word_embeddings": False}).eval()
    save_hf_model(policy.state_dict(), policy.hf_config, tmp_path)
    torch.manual_seed(1)
    rm = load_reward_model(tmp_path).eval()
    assert "lm_head.weight" not in rm.state_dict() and rm.score.weight.shape == (1, 64)
    ids, lengths = pad_right(sequences(), pad_id=0)
    with torch.no_grad():
        hidden = policy(ids)
        expected = rm.score(hidden[torch.arange(len(lengths)), lengths - 1]).squeeze(-1)
        assert torch.allclose(rm(ids, lengths), expected, atol=1e-6)
        # Padding after a sequence changes nothing: the score is read at its last real token.
        wider = torch.cat([ids, torch.zeros(len(ids), 5, dtype=torch.long)], dim=1)
        assert torch.allclose(rm(wider, lengths), expected, atol=1e-5)
    with pytest.raises(ValueError, match=r"every length must be in \[1, "):
        rm(ids, torch.zeros_like(lengths))

    (tmp_path / "config.json").write_text(json.dumps({**policy.hf_config, "architectures": ["Qwen3ForSequenceClassification"]}))
    with pytest.raises(CheckpointError, match="has no 'score.weight'"):
        load_reward_model(tmp_path)


def test_scored_lengths_end_at_the_last_trained_token():
    # Positions: prompt 0-2, completion 3-5 (5 = end of turn), template newline 6, padding 7.
    # labels[t] is the token at t + 1: trained for t = 2..4.
    labels = torch.full((2, 8), IGNORE_INDEX)
    labels[0, 2:5] = 1
    labels[1, 1:2] = 1
    assert scored_lengths(labels).tolist() == [6, 3]
    labels[1] = IGNORE_INDEX
    with pytest.raises(ValueError, match="no trained token"):
        scored_lengths(labels)


MOE = dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
# One tiny causal LM folder per native family, as transformers writes it (hf_testing.save_family: norms and biases
# away from their init): the ports' test configs, sliding windows shorter than the longest sequence scored.
NATIVE_RM_FAMILIES = {
    "llama": ("llama", dict(attention_bias=True)),
    "qwen2": ("qwen2-sliding", {}),
    "qwen3": ("qwen3", dict(num_key_value_heads=2, head_dim=16)),
    "qwen3_moe": ("qwen3_moe", dict(MOE, norm_topk_prob=True)),
    "qwen2_moe": ("qwen2_moe", dict(MOE, shared_expert_intermediate_size=24)),
    **{name: (name, {}) for name in ("mistral", "olmo2", "smollm3", "gemma3_text", "phi3")},
}


def scored_by_transformers(folder, vocab: int, n: int = 6) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(transformers' scores of right-padded random rows (pad id 0, attention mask set) of the sequence-classification
    folder, the same rows as (ids, lengths), and the class transformers loaded); no weight missing or left over."""
    transformers = pytest.importorskip("transformers")
    hf, info = transformers.AutoModelForSequenceClassification.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(1, vocab, (int(k),), generator=g).tolist() for k in torch.randint(2, 24, (n,), generator=g)]
    ids, lengths = pad_right(rows, pad_id=0)
    with torch.no_grad():
        expected = hf.eval()(ids, attention_mask=(ids != 0).long()).logits.squeeze(-1)
    return expected, (ids, lengths), type(hf).__name__


def test_every_native_family_is_tested_and_named_as_transformers_names_it():
    transformers = pytest.importorskip("transformers")
    from transformers.models.auto import modeling_auto

    assert set(NATIVE_RM_FAMILIES) == set(SUPPORTED_MODEL_TYPES) == set(FAMILIES)
    for model_type, family in FAMILIES.items():
        assert family.causal_lm == modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
        assert family.sequence_classification == modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES[model_type]
        assert hasattr(transformers, family.sequence_classification)


@pytest.mark.parametrize("model_type", sorted(NATIVE_RM_FAMILIES))
def test_each_native_family_saves_a_reward_model_transformers_scores_as_we_do(model_type, tmp_path):
    """A reward model on a causal LM folder of the family (the stage's start), saved: transformers loads the folder as
    the family's sequence classifier, every weight in place, and scores right-padded rows as `RewardModel` does."""
    from hf_testing import save_family

    name, overrides = NATIVE_RM_FAMILIES[model_type]
    save_family(name, tmp_path / "lm", **overrides)
    torch.manual_seed(1)
    model = load_reward_model(tmp_path / "lm").eval()
    assert isinstance(model, RewardModel) and model.args.model_type == model_type
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores of order 1, so 1e-4 is a real bound
    save_reward_model(model, tmp_path / "rm", pad_token_id=0)
    assert json.loads((tmp_path / "rm" / "config.json").read_text())["architectures"] == [
        FAMILIES[model_type].sequence_classification]
    expected, (ids, lengths), loaded = scored_by_transformers(tmp_path / "rm", model.args.vocab_size)
    assert loaded == FAMILIES[model_type].sequence_classification
    with torch.no_grad():
        ours = model(ids, lengths)
    assert expected.abs().max().item() > 0.1
    assert (ours - expected).abs().max().item() <= 1e-4, (ours, expected)


def gpt2_folder(folder, **overrides):
    """A tiny GPT-2 causal LM (no native port: the transformers backend), dropout off, pad id 0."""
    from hf_testing import save_family

    return save_family("gpt2", folder, n_inner=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **overrides)


def test_a_family_without_a_native_port_scores_through_transformers_own_classifier(tmp_path):
    """GPT-2 (transformers backend): the reward model on its causal LM folder keeps the decoder's weights under the
    checkpoint's names, draws the head from torch's RNG, and saves a GPT2ForSequenceClassification folder that
    transformers scores as we do; that folder loads back with the same scores."""
    from sft_testing import weights

    lm = gpt2_folder(tmp_path / "lm")
    torch.manual_seed(1)
    model = load_reward_model(tmp_path / "lm").eval()
    assert isinstance(model, HFRewardModel) and model.backend == "transformers"
    decoder = {k: v for k, v in weights(tmp_path / "lm").items() if k.startswith("transformer.")}
    state = model.state_dict()
    assert set(state) == set(decoder) | {"score.weight"} and all(torch.equal(state[k], v) for k, v in decoder.items())
    torch.manual_seed(1)
    assert torch.equal(load_reward_model(tmp_path / "lm").score.weight, state["score.weight"])  # seeded: the same head
    assert 0.005 < state["score.weight"].std().item() < 0.05  # drawn with the config's initializer_range (0.02)
    del lm

    torch.nn.init.normal_(model.score.weight, std=1.0)
    save_reward_model(model, tmp_path / "rm", pad_token_id=0)
    expected, (ids, lengths), loaded = scored_by_transformers(tmp_path / "rm", VOCAB_GPT2)
    assert loaded == "GPT2ForSequenceClassification"
    with torch.no_grad():
        ours = model(ids, lengths)
        reloaded = load_reward_model(tmp_path / "rm")(ids, lengths)
    assert expected.abs().max().item() > 0.1
    assert (ours - expected).abs().max().item() <= 1e-4 and torch.allclose(reloaded, ours, atol=1e-6)
    with pytest.raises(CheckpointError, match="PPO|ValueModel|native model code only"):
        from posttrain.rl.critic import ValueModel

        load_reward_model(tmp_path / "rm", model_class=ValueModel)


def test_a_family_transformers_cannot_classify_is_refused_naming_the_rule(tmp_path):
    from hf_testing import save_family

    save_family("granite", tmp_path / "granite")
    with pytest.raises(CheckpointError, match="model_type 'granite' runs on the transformers backend .* no sequence "
                                              r"classifier \(\*ForSequenceClassification\)"):
        load_reward_model(tmp_path / "granite")
    assert reward_model_backend_problem("granite", "native") is None  # a native family never asks transformers
    assert reward_model_backend_problem("gpt2", "transformers") is None
    assert reward_model_backend_problem("llama", "transformers") is None
