"""Chunked cross-entropy, token log-probs and entropy equal their full-logit computations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from posttrain.losses import chunked
from posttrain.losses.ce import full_cross_entropy, linear_cross_entropy, num_loss_tokens
from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.losses.logprobs import sequence_logprobs, token_logprobs, token_logprobs_and_entropy

B, S, D, V = 3, 11, 16, 97
CHUNKS = [1, 3, 8, 64]  # 64 > kept tokens: empty chunks are skipped


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def make_batch(seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    project = nn.Linear(D, V, bias=False).to(dtype)
    with torch.no_grad():
        project.weight.copy_(torch.randn(V, D, generator=g, dtype=dtype) * 0.5)
    hidden = torch.randn(B, S, D, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :4] = IGNORE_INDEX  # a prompt
    labels[1, -1] = IGNORE_INDEX  # a document end
    labels[2, 5] = IGNORE_INDEX
    return hidden, project, labels


def grads(loss: torch.Tensor, hidden: torch.Tensor, project: nn.Linear):
    gh, gw = torch.autograd.grad(loss, (hidden, project.weight))
    return gh, gw


@pytest.mark.parametrize("num_chunks", CHUNKS)
@pytest.mark.parametrize("checkpoint_chunks", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_matches_full(num_chunks, checkpoint_chunks, reduction):
    hidden, project, labels = make_batch()
    logits = hidden @ project.weight.T
    ref = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction=reduction)
    got = linear_cross_entropy(hidden, project, labels, num_chunks, checkpoint_chunks, reduction)
    assert rel_err(got, ref) <= 1e-5
    got_grads = grads(got, hidden, project)
    for g, r in zip(got_grads, grads(ref, hidden, project)):
        assert rel_err(g, r) <= 1e-5
    assert torch.all(got_grads[0][labels == IGNORE_INDEX] == 0)  # ignored positions: exactly zero


def test_full_cross_entropy_and_token_count():
    hidden, project, labels = make_batch(1)
    ref = F.cross_entropy((hidden @ project.weight.T).reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    assert rel_err(full_cross_entropy(hidden, project, labels), ref) <= 1e-6
    total = linear_cross_entropy(hidden, project, labels, reduction="sum")
    assert num_loss_tokens(labels).item() == B * S - 6
    assert rel_err(total / num_loss_tokens(labels), ref) <= 1e-5


def test_cross_entropy_all_ignored_is_zero_and_connected():
    hidden, project, labels = make_batch(2)
    labels.fill_(IGNORE_INDEX)
    loss = linear_cross_entropy(hidden, project, labels)
    assert loss.item() == 0.0
    gh, gw = grads(loss, hidden, project)  # graph reaches both, with zero gradient
    assert gh.abs().sum() == 0 and gw.abs().sum() == 0


def test_bfloat16_hidden_scores_in_float32():
    hidden, project, labels = make_batch(3, torch.bfloat16)
    loss = linear_cross_entropy(hidden, project, labels, num_chunks=4)
    assert loss.dtype == torch.float32
    ref = F.cross_entropy(project(hidden).float().reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    assert rel_err(loss, ref) <= 1e-5


def largest_saved_for_backward(hidden, project, labels, checkpoint_chunks: bool | None) -> int:
    """Elements of the largest tensor autograd saves outside the checkpointed chunks."""
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        linear_cross_entropy(hidden, project, labels, num_chunks=4, checkpoint_chunks=checkpoint_chunks)
    return max(sizes)


def test_checkpointed_chunks_keep_no_logits_for_backward():
    """Outside the checkpointed chunks autograd saves nothing vocabulary-sized; without
    checkpointing it saves every chunk's logits (so this test can tell the two apart)."""
    hidden, project, labels = make_batch(4)
    kept = num_loss_tokens(labels).item()
    assert largest_saved_for_backward(hidden, project, labels, True) < V * 4
    assert largest_saved_for_backward(hidden, project, labels, False) >= V * (kept // 4)


def test_default_recomputes_only_logits_above_the_threshold(monkeypatch):
    """checkpoint_chunks=None keeps small logits for backward, recomputes once all of them exceed
    RECOMPUTE_ABOVE_MIB, and always recomputes when the projection's width cannot be read."""
    hidden, project, labels = make_batch(4)
    kept = num_loss_tokens(labels).item()
    logits_mib = kept * V * 4 / 2**20
    monkeypatch.setattr(chunked, "RECOMPUTE_ABOVE_MIB", logits_mib * 1.01)
    assert largest_saved_for_backward(hidden, project, labels, None) >= V * (kept // 4)
    monkeypatch.setattr(chunked, "RECOMPUTE_ABOVE_MIB", logits_mib * 0.99)
    assert largest_saved_for_backward(hidden, project, labels, None) < V * 4
    monkeypatch.setattr(chunked, "RECOMPUTE_ABOVE_MIB", logits_mib * 1.01)
    assert largest_saved_for_backward(hidden, lambda h: project(h), labels, None) < V * 4


def naive_token_logprobs(hidden, project, targets, temperature=1.0):
    logp = torch.log_softmax((hidden @ project.weight.T).float() / temperature, dim=-1)
    return logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1), logp


@pytest.mark.parametrize("num_chunks", CHUNKS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_naive(num_chunks, temperature):
    hidden, project, labels = make_batch(5)
    mask = labels != IGNORE_INDEX
    ref_all, _ = naive_token_logprobs(hidden, project, labels, temperature)
    ref = ref_all * mask
    got = token_logprobs(hidden, project, labels, num_chunks=num_chunks, temperature=temperature)
    assert got.shape == (B, S) and torch.all(got[~mask] == 0)
    assert rel_err(got, ref) <= 1e-5
    weights = torch.randn(B, S)  # an arbitrary downstream use of every position
    for g, r in zip(grads((got * weights).sum(), hidden, project), grads((ref * weights).sum(), hidden, project)):
        assert rel_err(g, r) <= 1e-5


def test_explicit_mask_and_sequence_sums():
    hidden, project, labels = make_batch(6)
    targets = labels.clamp(min=0)
    mask = torch.rand(B, S, generator=torch.Generator().manual_seed(0)) > 0.3
    ref_all, _ = naive_token_logprobs(hidden, project, targets)
    sums, counts = sequence_logprobs(hidden, project, targets, mask, num_chunks=3)
    assert torch.equal(counts, mask.sum(-1))
    assert rel_err(sums, (ref_all * mask).sum(-1)) <= 1e-5
    gs = grads(sums.sum(), hidden, project)
    gr = grads((ref_all * mask).sum(), hidden, project)
    for g, r in zip(gs, gr):
        assert rel_err(g, r) <= 1e-5


@pytest.mark.parametrize("num_chunks", [1, 5])
def test_entropy_matches_naive(num_chunks):
    hidden, project, labels = make_batch(7)
    mask = labels != IGNORE_INDEX
    ref_lp, logp = naive_token_logprobs(hidden, project, labels, 0.9)
    ref_ent = -(logp.exp() * logp).sum(-1) * mask
    lp, ent = token_logprobs_and_entropy(hidden, project, labels, num_chunks=num_chunks, temperature=0.9)
    assert rel_err(lp, ref_lp * mask) <= 1e-5
    assert rel_err(ent, ref_ent) <= 1e-5
    assert torch.all(ent[mask] > 0) and torch.all(ent[mask] <= torch.log(torch.tensor(float(V))) + 1e-5)
    for g, r in zip(grads(ent.sum(), hidden, project), grads(ref_ent.sum(), hidden, project)):
        assert rel_err(g, r) <= 1e-5


def test_no_grad_path_runs_without_checkpoint():
    hidden, project, labels = make_batch(8)
    with torch.no_grad():
        got = token_logprobs(hidden, project, labels, num_chunks=2)
    ref, _ = naive_token_logprobs(hidden.detach(), project, labels)
    assert not got.requires_grad
    assert rel_err(got, ref * (labels != IGNORE_INDEX)) <= 1e-5


def test_bad_inputs_raise():
    hidden, project, labels = make_batch(9)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, project, labels, reduction="none")
    with pytest.raises(ValueError, match="num_chunks"):
        linear_cross_entropy(hidden, project, labels, num_chunks=0)
    with pytest.raises(ValueError, match="mask shape"):
        token_logprobs(hidden, project, labels, labels[:, :-1] != IGNORE_INDEX)
    with pytest.raises(ValueError, match="leading shape"):
        token_logprobs(hidden[:, :-1], project, labels)
