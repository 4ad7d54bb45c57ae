"""GRPO advantages and policy-loss variants equal a float64 reference written from the formula."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from posttrain.losses.grpo import group_advantages, grpo_loss

GROUPS, K, T = 3, 4, 9
B = GROUPS * K


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios beyond the clip
    gen = old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)  # weights beyond the cap
    ref = logprobs.detach() + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths.unsqueeze(1)
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    return logprobs, old, gen, ref, mask, advantages


def reference_loss(logprobs, old, adv, mask, eps, token_level, ref=None, kl_coef=0.0, gen=None, cap=2.0):
    """Token by token from the formula: -w min(r A, clip(r) A) + kl_coef (e^x - x - 1), x = ref - logp."""
    per_seq, total, tokens = [], 0.0, 0
    for i in range(B):
        seq_total, seq_tokens = 0.0, 0
        for t in range(T):
            if not mask[i, t]:
                continue
            r = torch.exp(logprobs[i, t] - old[i, t])
            term = -torch.minimum(r * adv[i], torch.clamp(r, 1 - eps, 1 + eps) * adv[i])
            if gen is not None:
                term = term * min(math.exp(old[i, t].item() - gen[i, t].item()), cap)
            if ref is not None:
                x = ref[i, t] - logprobs[i, t]
                term = term + kl_coef * (torch.exp(x) - x - 1)
            seq_total, seq_tokens = seq_total + term, seq_tokens + 1
        per_seq.append(seq_total / seq_tokens)
        total, tokens = total + seq_total, tokens + seq_tokens
    return total / tokens if token_level else sum(per_seq) / len(per_seq)


VARIANTS = {
    "sequence_mean": dict(token_level=False),
    "token_level": dict(token_level=True),
    "kl_k3": dict(token_level=True, kl_coef=0.05, with_ref=True),
    "truncated_is": dict(token_level=False, with_gen=True, cap=1.5),
    "all": dict(token_level=True, kl_coef=0.1, with_ref=True, with_gen=True, cap=2.0),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_grpo_loss_matches_float64_reference(variant):
    opts = VARIANTS[variant]
    logprobs, old, gen, ref, mask, adv = batch(list(VARIANTS).index(variant))
    ref_in = ref if opts.get("with_ref") else None
    gen_in = gen if opts.get("with_gen") else None
    kw = dict(token_level=opts["token_level"], ref_logprobs=ref_in, kl_coef=opts.get("kl_coef", 0.0))
    if gen_in is not None:
        kw.update(generator_logprobs=gen_in, tis_cap=opts["cap"])
    loss, metrics = grpo_loss(logprobs, old, adv, mask, clip_eps=0.2, **kw)
    kl_coef, cap = opts.get("kl_coef", 0.0), opts.get("cap", 2.0)
    expected = reference_loss(logprobs, old, adv, mask, 0.2, opts["token_level"], ref_in, kl_coef, gen_in, cap)
    assert abs(loss.item() - expected.item()) <= 1e-12 * abs(expected.item())
    (g_got,) = torch.autograd.grad(loss, logprobs)
    (g_ref,) = torch.autograd.grad(expected, logprobs)
    torch.testing.assert_close(g_got, g_ref, rtol=1e-10, atol=1e-14)
    assert torch.all(g_got[~mask] == 0)
    assert ("kl" in metrics) == (ref_in is not None)
    assert ("tis/weight_mean" in metrics) == (gen_in is not None)


def test_grpo_metrics():
    logprobs, old, gen, ref, mask, adv = batch(7)
    _, m = grpo_loss(logprobs, old, adv, mask, clip_eps=0.2, ref_logprobs=ref, generator_logprobs=gen, tis_cap=1.5)
    ratio = torch.exp(logprobs - old).detach()[mask]
    a = adv.unsqueeze(1).expand(B, T)[mask]
    clipped = ((ratio > 1.2) & (a > 0)) | ((ratio < 0.8) & (a < 0))
    assert 0 < m["clip_frac"].item() < 1
    assert m["clip_frac"].item() == pytest.approx(clipped.double().mean().item())
    assert m["ratio/min"].item() == pytest.approx(ratio.min().item())
    assert m["ratio/max"].item() == pytest.approx(ratio.max().item())
    assert m["ratio/mean"].item() == pytest.approx(ratio.mean().item())
    x = (ref - logprobs.detach())[mask]
    assert m["kl"].item() == pytest.approx((x.exp() - x - 1).mean().item())
    assert m["kl"].item() >= 0
    weights = torch.exp(old - gen)[mask]
    assert m["tis/truncated_frac"].item() == pytest.approx((weights > 1.5).double().mean().item())
    assert m["tis/weight_mean"].item() == pytest.approx(weights.clamp(max=1.5).mean().item())


def test_on_policy_loss_is_minus_mean_advantage_and_kl_zero():
    """At ratio 1 with reference = policy the token-level loss is -sum(A * len) / tokens, KL 0."""
    logprobs, _, _, _, mask, adv = batch(8)
    loss, m = grpo_loss(logprobs, logprobs.detach(), adv, mask, ref_logprobs=logprobs.detach(), kl_coef=1.0)
    expected = -(adv * mask.sum(1)).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert m["kl"].item() == 0 and m["clip_frac"].item() == 0


def test_denominator_splits_microbatches_exactly():
    """Token-level sums over micro-batches with the step's token count equal the whole-batch loss."""
    logprobs, old, _, _, mask, adv = batch(9)
    whole, _ = grpo_loss(logprobs, old, adv, mask)
    halves = sum(
        grpo_loss(logprobs[s], old[s], adv[s], mask[s], denominator=mask.sum())[0]
        for s in (slice(0, B // 2), slice(B // 2, B))
    )
    assert halves.item() == pytest.approx(whole.item(), rel=1e-12)


@pytest.mark.parametrize("std_normalize", [True, False])
def test_group_advantages_match_formula(std_normalize):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    got = group_advantages(rewards, K, std_normalize=std_normalize, eps=1e-6)
    for g in range(GROUPS):
        group = rewards[g * K : (g + 1) * K].tolist()
        mean, std = statistics.mean(group), statistics.stdev(group)
        for j, r in enumerate(group):
            expected = (r - mean) / (std + 1e-6) if std_normalize else r - mean
            assert got[g * K + j].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert torch.all(got[4:8] == 0)  # a group with equal rewards carries no signal


def test_bad_shapes_raise():
    logprobs, old, _, _, mask, adv = batch(10)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(10), 4)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logprobs, old, adv[:-1], mask)
