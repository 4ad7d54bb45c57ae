"""ORPO (reference-free odds-ratio preference optimization) and KTO (unpaired completions): each loss
against an independent float64 implementation of the paper's formula, one optimizer step lowers it,
the unpaired data they train on, and the DPO stage trains with each (ORPO without any reference
model; KTO with its reference point measured over the whole step, so grad_accum leaves it alone)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from method_testing import lowered_by_one_step
from posttrain.data.sources import BadRowError, canonical_rows, unpair
from posttrain.losses.dpo import kto_loss, kto_reference_point, orpo_loss, pair_reward_type, preference_loss

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


def _kto_reference(policy, reference, desirable, kl_policy, kl_reference, beta, lam_d, lam_u):
    """Ethayarajh et al. 2024, eq. 8: z0 = max(0, mean KL estimate); L = E[lambda_y - v(x, y)],
    v = lambda_D sigma(beta (r - z0)) for desirable y, lambda_U sigma(beta (z0 - r)) otherwise."""
    z0 = max(0.0, sum(p - q for p, q in zip(kl_policy, kl_reference)) / len(kl_policy))
    total = 0.0
    for p, q, good in zip(policy, reference, desirable):
        r = p - q
        if good:
            total += lam_d - lam_d / (1 + math.exp(-beta * (r - z0)))
        else:
            total += lam_u - lam_u / (1 + math.exp(-beta * (z0 - r)))
    return total / len(policy), z0


def test_kto_matches_the_papers_formula():
    n = 11
    policy, reference = -RNG.uniform(1, 20, size=n), -RNG.uniform(1, 20, size=n)
    kl_policy, kl_reference = -RNG.uniform(5, 25, size=n), -RNG.uniform(5, 25, size=n)
    desirable = RNG.random(n) < 0.4
    expected, z0_expected = _kto_reference(policy, reference, desirable, kl_policy, kl_reference, 0.3, 1.0, 1.33)
    z0 = kto_reference_point(torch.tensor(kl_policy).sum(), torch.tensor(kl_reference).sum(), n)
    assert z0.item() == pytest.approx(z0_expected, rel=1e-12, abs=1e-15)
    got, metrics = kto_loss(torch.tensor(policy), torch.tensor(reference), torch.tensor(desirable), z0,
                            beta=0.3, desirable_weight=1.0, undesirable_weight=1.33)
    assert got.item() == pytest.approx(expected, rel=1e-12)
    right = [(p - q > z0_expected) == good for p, q, good in zip(policy, reference, desirable)]
    assert metrics["rewards/accuracy"].item() == pytest.approx(np.mean(right))
    # z0 is clamped at zero: a policy closer to the reference than nothing is no negative KL
    assert kto_reference_point(torch.tensor(-5.0), torch.tensor(1.0), 3).item() == 0.0
    assert pair_reward_type("kto") == "sigmoid" and pair_reward_type("ipo") == "ipo"


def test_one_optimizer_step_lowers_the_kto_loss():
    torch.manual_seed(0)
    rows, length, vocab = 8, 5, 13
    logits = torch.nn.Parameter(torch.randn(rows, length, vocab))
    targets = torch.randint(0, vocab, (rows, length))
    reference = torch.randn(rows) - 8.0
    desirable = torch.tensor([True, False] * (rows // 2))
    z0 = torch.tensor(0.5)

    def loss() -> torch.Tensor:
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0].sum(-1)
        return kto_loss(logp, reference, desirable, z0, beta=0.5)[0]

    assert lowered_by_one_step(logits, loss)


def test_unpaired_rows_and_pairs_unpaired():
    rows, _ = canonical_rows([{"prompt": "2+2?", "completion": "4", "label": True},
                              {"prompt": "2+2?", "completion": "5", "label": 0}], "unpaired", "u.jsonl")
    assert [r["desirable"] for r in rows] == [True, False]
    assert rows[0]["completion"] == [{"role": "assistant", "content": "4"}]
    with pytest.raises(BadRowError, match=r"u.jsonl: row 0: field label .*must be true/false"):
        canonical_rows([{"prompt": "p", "completion": "c", "label": "yes"}], "unpaired", "u.jsonl")
    pair = {"prompt": [{"role": "user", "content": "p"}], "chosen": ["c"], "rejected": ["r"]}
    assert unpair([pair]) == [{"prompt": pair["prompt"], "completion": ["c"], "desirable": True},
                              {"prompt": pair["prompt"], "completion": ["r"], "desirable": False}]


@pytest.mark.slow
def test_the_dpo_stage_trains_kto_on_the_unpaired_split_the_same_with_grad_accum(tmp_path):
    from posttrain.data.store import load_split
    from test_dpo_stage import SHORT, dpo_config, run_dpo, sft_policy, step_values, summary

    data, sft_dir = sft_policy(tmp_path)
    unpaired, pairs = load_split(data, "unpaired"), load_split(data, "preference")
    assert len(unpaired) == 2 * len(pairs) and sum(unpaired["desirable"]) == len(pairs)
    n = len(unpaired)
    assert list(unpaired[0]["rejected_input_ids"]) != list(unpaired[1]["chosen_input_ids"])
    assert list(unpaired[0]["rejected_labels"])[-5:] == list(unpaired[n // 2]["chosen_labels"])[-5:]  # the row half a split away
    runs = {}
    for accum in (1, 2):
        out = tmp_path / f"kto{accum}"
        run_dpo(dpo_config(f"kto{accum}", **{**SHORT, "loss": "kto", "grad_accum": accum, "steps": 3}), data, sft_dir, out)
        runs[accum] = out
    kl = step_values(runs[1], "kl")
    assert len(kl) == 3 and all(k >= 0 for k in kl)
    assert step_values(runs[2], "kl") == pytest.approx(kl, rel=1e-5)  # z0 over the whole step, not per micro-batch
    assert step_values(runs[2]) == pytest.approx(step_values(runs[1]), rel=1e-4)
    result = summary(runs[1])
    assert result["steps"] == 3 and 0.0 <= result["pref_acc"] <= 1.0
