"""DPO, IPO and SimPO equal float64 references written from their papers' formulas."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.losses.dpo import dpo_loss, ipo_loss, preference_loss, simpo_loss
from posttrain.losses.logprobs import sequence_logprobs

N = 7


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def random_logps(seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (4, N), generator=g)
    logps = -torch.rand(4, N, generator=g, dtype=torch.float64) * lengths * 3  # sums over tokens
    pc, pr, rc, rr = (x.to(dtype).requires_grad_(i < 2) for i, x in enumerate(logps))
    return pc, pr, rc, rr, lengths[0], lengths[1]


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_dpo_matches_paper_formula(label_smoothing, dtype, tol):
    pc, pr, rc, rr, _, _ = random_logps(0, dtype)
    beta = 0.3
    loss, metrics = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=label_smoothing)
    expected, correct = 0.0, 0
    for i in range(N):
        # Rafailov et al. eq. 7; conservative DPO mixes in the flipped label with weight eps
        h = beta * ((pc[i].item() - rc[i].item()) - (pr[i].item() - rr[i].item()))
        expected += -(1 - label_smoothing) * log_sigmoid(h) - label_smoothing * log_sigmoid(-h)
        correct += h > 0
    expected /= N
    assert loss.dtype == dtype
    assert abs(loss.item() - expected) <= tol * abs(expected)
    assert metrics["rewards/accuracy"].item() == pytest.approx(correct / N)
    margin = beta * ((pc - rc) - (pr - rr)).mean().item()
    assert metrics["rewards/margin"].item() == pytest.approx(margin, rel=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_ipo_matches_paper_formula(dtype, tol):
    pc, pr, rc, rr, lc, lr = random_logps(1, dtype)
    tau = 0.1
    loss, metrics = ipo_loss(pc, pr, rc, rr, lc, lr, beta=tau)
    expected = 0.0
    for i in range(N):
        # Azar et al. eq. 17 with length-averaged log-probs: (h - 1/(2 tau))^2
        h = (pc[i].item() - rc[i].item()) / lc[i].item() - (pr[i].item() - rr[i].item()) / lr[i].item()
        expected += (h - 1 / (2 * tau)) ** 2
    expected /= N
    assert abs(loss.item() - expected) <= tol * abs(expected)
    assert 0.0 <= metrics["rewards/accuracy"].item() <= 1.0


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_simpo_matches_paper_formula(dtype, tol):
    pc, pr, _, _, lc, lr = random_logps(2, dtype)
    beta, gamma = 2.5, 0.8
    loss, metrics = simpo_loss(pc, pr, lc, lr, beta=beta, gamma=gamma)
    expected = 0.0
    for i in range(N):
        # Meng et al. eq. 6: -log sigma(beta/|y_w| log pi(y_w) - beta/|y_l| log pi(y_l) - gamma)
        expected += -log_sigmoid(beta * pc[i].item() / lc[i].item() - beta * pr[i].item() / lr[i].item() - gamma)
    expected /= N
    assert abs(loss.item() - expected) <= tol * abs(expected)
    assert metrics["rewards/chosen"].item() == pytest.approx((beta * pc / lc).mean().item(), rel=1e-6)


def test_dpo_gradient_matches_closed_form():
    # d/d pi_c of -log sigma(beta h) = -beta * sigma(-beta h) / N
    pc, pr, rc, rr, _, _ = random_logps(3)
    beta = 0.5
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=beta)
    (grad_c,) = torch.autograd.grad(loss, pc)
    h = beta * ((pc - rc) - (pr - rr)).detach()
    torch.testing.assert_close(grad_c, -beta * torch.sigmoid(-h) / N, rtol=1e-12, atol=0)


def test_preference_loss_dispatch_and_errors():
    pc, pr, rc, rr, lc, lr = random_logps(4)
    kw = dict(beta=0.2, label_smoothing=0.1, simpo_gamma=0.3)
    assert preference_loss("sigmoid", pc, pr, lc, lr, rc, rr, **kw)[0] == dpo_loss(pc, pr, rc, rr, 0.2, 0.1)[0]
    assert preference_loss("ipo", pc, pr, lc, lr, rc, rr, **kw)[0] == ipo_loss(pc, pr, rc, rr, lc, lr, 0.2)[0]
    assert preference_loss("simpo", pc, pr, lc, lr, **kw)[0] == simpo_loss(pc, pr, lc, lr, 0.2, 0.3)[0]
    with pytest.raises(ValueError, match="dpo.loss"):
        preference_loss("hinge", pc, pr, lc, lr, rc, rr, **kw)
    with pytest.raises(ValueError, match="reference"):
        preference_loss("sigmoid", pc, pr, lc, lr, **kw)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(pc, pr, rc, rr, label_smoothing=0.5)


def test_dpo_on_chunked_sequence_logprobs_equals_full_logits():
    """The chosen/rejected log-probs from the chunked path give the full-logit DPO loss."""
    g = torch.Generator().manual_seed(5)
    pairs, seq, dim, vocab = 4, 13, 16, 97
    policy, reference = nn.Linear(dim, vocab, bias=False), nn.Linear(dim, vocab, bias=False)
    hidden = torch.randn(2 * pairs, seq, dim, generator=g, requires_grad=True)  # chosen rows, then rejected
    ref_hidden = torch.randn(2 * pairs, seq, dim, generator=g)
    labels = torch.randint(0, vocab, (2 * pairs, seq), generator=g)
    for row, prompt_len in enumerate(torch.randint(1, 6, (2 * pairs,), generator=g).tolist()):
        labels[row, :prompt_len] = IGNORE_INDEX
    labels[:, -1] = IGNORE_INDEX

    def full_sums(h, proj):
        logp = torch.log_softmax(proj(h).float(), -1)
        mask = labels != IGNORE_INDEX
        return (logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask).sum(-1)

    pol, _ = sequence_logprobs(hidden, policy, labels, num_chunks=3)
    with torch.no_grad():
        ref, _ = sequence_logprobs(ref_hidden, reference, labels, num_chunks=3)
    loss, _ = dpo_loss(pol[:pairs], pol[pairs:], ref[:pairs], ref[pairs:], beta=0.1)
    full_pol, full_ref = full_sums(hidden, policy), full_sums(ref_hidden, reference).detach()
    full_loss, _ = dpo_loss(full_pol[:pairs], full_pol[pairs:], full_ref[:pairs], full_ref[pairs:], beta=0.1)
    torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=0)
    (g_chunked,) = torch.autograd.grad(loss, hidden)
    (g_full,) = torch.autograd.grad(full_loss, hidden)
    assert ((g_chunked - g_full).norm() / g_full.norm()).item() <= 1e-5


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_chosen_nll_term_adds_the_weighted_per_token_nll_of_the_chosen_responses(loss_type):
    pc, pr, rc, rr, lc, lr = random_logps(5)
    refs = (rc, rr) if loss_type != "simpo" else ()
    plain, _ = preference_loss(loss_type, pc, pr, lc, lr, *refs, beta=0.2)
    with_nll, metrics = preference_loss(loss_type, pc, pr, lc, lr, *refs, beta=0.2, chosen_nll_weight=0.7)
    nll = sum(-pc[i].item() / lc[i].item() for i in range(N)) / N  # RPO: mean over pairs of the per-token NLL
    assert with_nll.item() == pytest.approx(plain.item() + 0.7 * nll, rel=1e-12)
    assert metrics["nll/chosen"].item() == pytest.approx(nll, rel=1e-12)
