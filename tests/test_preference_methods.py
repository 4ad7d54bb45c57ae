"""ORPO (reference-free odds-ratio preference optimization): the loss against an independent float64
implementation of the paper's formula, one optimizer step lowers it, and the DPO stage trains with it
without any reference model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from method_testing import lowered_by_one_step
from posttrain.losses.dpo import orpo_loss, preference_loss

RNG = np.random.default_rng(11)


def _orpo_reference(chosen, rejected, chosen_len, rejected_len, lam):
    """Hong et al. 2024, eq. 6-7: L_SFT + lambda * L_OR with odds(y|x) = P / (1 - P), P the length-normalized likelihood."""
    total = 0.0
    for c, r, lc, lr in zip(chosen, rejected, chosen_len, rejected_len):
        pc, pr = math.exp(c / lc), math.exp(r / lr)
        log_odds_ratio = math.log(pc / (1 - pc)) - math.log(pr / (1 - pr))
        total += -c / lc - lam * math.log(1 / (1 + math.exp(-log_odds_ratio)))
    return total / len(chosen)


def test_orpo_matches_the_papers_formula():
    lengths_c, lengths_r = RNG.integers(1, 12, size=9), RNG.integers(1, 12, size=9)
    chosen = -RNG.uniform(0.05, 3.0, size=9) * lengths_c
    rejected = -RNG.uniform(0.05, 3.0, size=9) * lengths_r
    got, metrics = orpo_loss(torch.tensor(chosen), torch.tensor(rejected), torch.tensor(lengths_c),
                             torch.tensor(lengths_r), beta=0.25)
    assert got.item() == pytest.approx(_orpo_reference(chosen, rejected, lengths_c, lengths_r, 0.25), rel=1e-12)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.25 * np.mean(chosen / lengths_c), rel=1e-12)
    # Dispatch: no reference log-probs needed; the chosen NLL is part of the loss.
    same, _ = preference_loss("orpo", torch.tensor(chosen), torch.tensor(rejected), torch.tensor(lengths_c),
                              torch.tensor(lengths_r), beta=0.25)
    assert same.item() == got.item()


def test_one_optimizer_step_lowers_the_orpo_loss():
    torch.manual_seed(0)
    pairs, length, vocab = 6, 5, 13
    logits = torch.nn.Parameter(torch.randn(2 * pairs, length, vocab))
    targets = torch.randint(0, vocab, (2 * pairs, length))
    lengths = torch.full((pairs,), length)

    def loss() -> torch.Tensor:
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0].sum(-1)
        return orpo_loss(logp[:pairs], logp[pairs:], lengths, lengths, beta=0.5)[0]

    assert lowered_by_one_step(logits, loss)


@pytest.mark.slow
def test_the_dpo_stage_trains_with_orpo_and_no_reference(tmp_path):
    from test_dpo_stage import SHORT, dpo_config, run_dpo, sft_policy, summary

    data, sft_dir = sft_policy(tmp_path)
    out = tmp_path / "orpo"
    proc = run_dpo(dpo_config("orpo", **{**SHORT, "loss": "orpo", "beta": 0.2, "steps": 6}), data, sft_dir, out)
    assert "reference: training pairs" not in proc.stderr + proc.stdout  # no precomputed reference pass
    result = summary(out)
    assert result["reference"] is None and result["steps"] == 6 and 0.0 <= result["pref_acc"] <= 1.0
