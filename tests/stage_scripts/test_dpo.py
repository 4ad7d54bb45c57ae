"""DPO pieces on real prepared pairs: pair log-probs vs. full logits, scoring passes, the reference cache,
the LoRA reference. The stage itself is tested in test_dpo_stage.py."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from posttrain.data.loader import preference_batches
from posttrain.dpo import (
    OnlineReference,
    PrecomputedReference,
    fingerprint,
    load_cache,
    model_files,
    pair_logprobs,
    save_cache,
    score_pairs,
)
from posttrain.model_files import save_hf_model
from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.losses.dpo import dpo_loss
from posttrain.losses.head import OutputHead
from posttrain.models import Transformer, preset_config
from posttrain.models.lora import apply_lora
from posttrain.tokenizer import Tokenizer
from sft_testing import prepare_data

MEMORY = {"chunked_ce": True, "ce_chunks": 4}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepare_data(tmp_path_factory.mktemp("dpo-unit"), {"n_sft": 200, "n_preference": 24, "n_eval": 20})


@pytest.fixture(scope="module")
def pairs(data_dir):
    return preference_batches(data_dir, 6, seed=0, shuffle=False, loop=False)


def _model(seed: int, vocab: int) -> Transformer:
    torch.manual_seed(seed)  # a wide init: peaked, model-specific log-probs
    return Transformer(preset_config("tiny-student", vocab_size=vocab, initializer_range=0.2))


@pytest.fixture(scope="module")
def vocab(data_dir) -> int:
    return Tokenizer(data_dir / "tokenizer").vocab_size


def _full_logit_sums(model: Transformer, batch: dict[str, torch.Tensor], side: str) -> torch.Tensor:
    """Each row alone, unpadded, through the full [S, V] logits, log-softmax in float64."""
    sums = []
    for ids, labels in zip(batch[f"{side}_input_ids"], batch[f"{side}_labels"]):
        keep = int((labels != IGNORE_INDEX).nonzero().max()) + 2  # through the last scored target
        ids, labels = ids[:keep], labels[:keep]
        logps = torch.log_softmax(model.logits(model(ids[None]))[0].double(), dim=-1)
        mask = labels != IGNORE_INDEX
        sums.append(logps[mask].gather(-1, labels[mask, None]).sum())
    return torch.stack(sums)


def test_dpo_loss_on_a_real_batch_equals_full_logits(pairs, vocab):
    """Chosen and rejected padded into one chunked forward give the loss and gradient of per-row full logits."""
    batch = next(iter(pairs))
    assert batch["chosen_input_ids"].shape[0] == 6
    policy, reference = _model(0, vocab), _model(1, vocab)

    ours = pair_logprobs(policy, OutputHead(policy, None, MEMORY), batch)
    with torch.no_grad():
        ref = pair_logprobs(reference, OutputHead(reference, None, MEMORY), batch)
    loss, _ = dpo_loss(ours.chosen, ours.rejected, ref.chosen, ref.rejected, beta=0.5)
    (grad,) = torch.autograd.grad(loss, policy.model.embed_tokens.weight)

    full = {side: _full_logit_sums(policy, batch, side) for side in ("chosen", "rejected")}
    with torch.no_grad():
        full_ref = {side: _full_logit_sums(reference, batch, side) for side in ("chosen", "rejected")}
    full_loss, _ = dpo_loss(full["chosen"], full["rejected"], full_ref["chosen"], full_ref["rejected"], beta=0.5)
    (full_grad,) = torch.autograd.grad(full_loss, policy.model.embed_tokens.weight)

    torch.testing.assert_close(ours.chosen.double(), full["chosen"], rtol=1e-5, atol=0)
    torch.testing.assert_close(ours.rejected.double(), full["rejected"], rtol=1e-5, atol=0)
    assert abs(loss.item() - full_loss.item()) <= 1e-5 * abs(full_loss.item())
    assert abs(loss.item() - np.log(2)) > 1e-3  # policy and reference differ: the check has teeth
    assert ((grad.double() - full_grad).norm() / full_grad.norm()).item() <= 1e-4
    counts = (batch["chosen_labels"] != IGNORE_INDEX).sum(-1)
    assert torch.equal(ours.chosen_tokens, counts)


def test_score_pairs_covers_every_row_in_order(pairs, vocab):
    """A scoring pass with a short last slice (padded forwards) returns each row's own log-probs."""
    model = _model(0, vocab)
    n = len(pairs.dataset)
    scored = score_pairs(model, OutputHead(model, None, MEMORY), pairs.dataset, pairs.collate, 5, torch.device("cpu"), "test",
                         False)
    assert scored.chosen.shape == (n,) and n % 5
    rows = np.array([3, 0, n - 1])
    with torch.no_grad():
        direct = pair_logprobs(model, OutputHead(model, None, MEMORY), pairs.collate(pairs.dataset[rows], rows))
    torch.testing.assert_close(scored.chosen[rows], direct.chosen, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(scored.rejected[rows], direct.rejected, rtol=1e-6, atol=1e-5)
    assert torch.equal(scored.rejected_tokens[rows], direct.rejected_tokens)

    lookup = PrecomputedReference(scored.chosen, scored.rejected)
    batch = pairs.collate(pairs.dataset[rows], rows)
    assert torch.equal(lookup(batch)[0], scored.chosen[rows])


def test_reference_cache_roundtrip_and_invalidation(tmp_path, vocab):
    model = _model(0, vocab)
    folder = tmp_path / "sft"
    save_hf_model(model.state_dict(), model.hf_config, folder)
    key = fingerprint(key="k", model=model_files(str(folder)), rows=24)
    tensors = {"train_chosen": torch.randn(24), "train_rejected": torch.randn(24)}
    path = tmp_path / "out.resume" / "reference_logps.safetensors"
    save_cache(path, tensors, key)
    loaded = load_cache(path, key)
    assert loaded is not None and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, f"{path.name}.blake3"]  # no temporary file left

    assert load_cache(path, fingerprint(key="k", model=model_files(str(folder)), rows=25)) is None
    time.sleep(0.01)
    save_hf_model(model.state_dict(), model.hf_config, folder)  # the model rewritten: another fingerprint
    assert fingerprint(key="k", model=model_files(str(folder)), rows=24) != key
    assert load_cache(tmp_path / "missing.safetensors", key) is None
    assert model_files("tiny") == "preset:tiny"
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0x01  # the last value's lowest bit: the file still parses, with another number in it
    path.write_bytes(bytes(damaged))
    assert load_cache(path, key) is None  # its digest differs: computed again, never read


def test_lora_online_reference_is_the_base_model(pairs, vocab):
    """With adapters trained away from zero, the online reference still scores with the frozen base."""
    base = _model(0, vocab)
    model = _model(0, vocab)
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=("q_proj", "v_proj", "down_proj"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    batch = next(iter(pairs))
    with torch.no_grad():
        expected = pair_logprobs(base, OutputHead(base, None, MEMORY), batch)
        adapted = pair_logprobs(model, OutputHead(model, None, MEMORY), batch)
    ref_chosen, ref_rejected = OnlineReference(model, OutputHead(model, None, MEMORY))(batch)
    torch.testing.assert_close(ref_chosen, expected.chosen, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ref_rejected, expected.rejected, rtol=1e-6, atol=1e-5)
    assert not torch.allclose(adapted.chosen, expected.chosen)
    assert not any(m.disabled for m in model.modules() if hasattr(m, "disabled"))  # switched back on
