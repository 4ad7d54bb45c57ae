"""Reward model parts: Bradley-Terry loss vs its formula, the HF sequence-classification export
against transformers, starting from a causal LM folder, and where the score is read."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.model_files import CheckpointError, save_hf_model
from posttrain.losses.bradley_terry import bradley_terry_loss
from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.models import Transformer
from posttrain.rewards import RewardModel, load_reward_model, pad_right, save_reward_model, score_sequences, scored_lengths

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
