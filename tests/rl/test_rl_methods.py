"""RL methods beside GRPO: RLOO and REINFORCE++ advantages, GSPO's sequence-level ratio and DAPO's clip-higher,
each against an independent float64 implementation of the paper's formula (loops and numpy, not the
library's tensor code), and one optimizer step on each loss lowers it; DAPO's dynamic sampling on
scripted draws (which groups a step keeps, the bound on extra draws); PPO's GAE, value loss and
whitening against float64 loops."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from method_testing import lowered_by_one_step
from posttrain.losses.grpo import group_advantages, grpo_loss
from posttrain.losses.ppo import clipped_value_loss, gae, whiten
from posttrain.rl.batch import advantages
from posttrain.rl.collection import _Collection, _Draw, informative
from posttrain.rl.rollout import RolloutGroup, rollout_stats

RNG = np.random.default_rng(7)


def test_rloo_subtracts_the_mean_of_the_other_completions():
    groups, k = 5, 4
    rewards = RNG.normal(size=groups * k)
    expected = np.array([rewards[i] - np.mean([rewards[j] for j in range(g * k, (g + 1) * k) if j != i])
                         for g in range(groups) for i in range(g * k, (g + 1) * k)])
    got = group_advantages(torch.tensor(rewards), k, estimator="rloo")
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)


def _groups(rewards: np.ndarray, k: int) -> list[RolloutGroup]:
    return [RolloutGroup(prompt_ids=[1], example={}, completions=[[2]] * k, logprobs=[[-1.0]] * k,
                         finish_reasons=["stop"] * k, rewards=list(rewards[g * k:(g + 1) * k]),
                         correct=[False] * k, version=0, index=g)
            for g in range(len(rewards) // k)]


def test_reinforce_pp_normalizes_group_centred_rewards_over_the_whole_step():
    k = 4
    rewards = RNG.integers(0, 3, size=8 * k).astype(np.float64)
    centred = [rewards[i] - rewards[i // k * k:(i // k + 1) * k].mean() for i in range(len(rewards))]
    mean, std = np.mean(centred), np.std(centred, ddof=1)
    expected = [(c - mean) / (std + 1e-6) for c in centred]
    whole = advantages(_groups(rewards, k), std_normalize=True, estimator="reinforce_pp")
    np.testing.assert_allclose(whole.numpy(), expected, rtol=1e-5, atol=1e-6)
    # Split over two data-parallel ranks: the global sums give each rank its share of the same advantages.
    halves = [_groups(rewards[:4 * k], k), _groups(rewards[4 * k:], k)]
    centred = [group_advantages(torch.tensor([r for g in h for r in g.rewards], dtype=torch.float32), k,
                                estimator="reinforce_pp").double() for h in halves]
    summed = [sum(float(c.sum()) for c in centred), sum(float(c.square().sum()) for c in centred),
              sum(c.numel() for c in centred)]
    shards = [advantages(h, True, "reinforce_pp", batch_sums=lambda values: summed) for h in halves]
    torch.testing.assert_close(torch.cat(shards), whole)


def _case(batch: int = 6, length: int = 7, seed: int = 0):
    g = np.random.default_rng(seed)
    logp = np.log(g.uniform(0.05, 0.95, size=(batch, length)))
    old = logp + g.normal(scale=0.3, size=logp.shape)
    adv = g.normal(size=batch)
    mask = (g.uniform(size=logp.shape) > 0.25).astype(np.float64)
    mask[:, 0] = 1.0
    return logp, old, adv, mask


def _reference(logp, old, adv, mask, low, high, level):
    """The papers' formulas, written out per sequence and token."""
    if level == "sequence":  # GSPO, eq. 5-7: s_i = (pi / pi_old)^(1/|y_i|), a mean over sequences
        total = 0.0
        for i in range(len(adv)):
            tokens = mask[i] > 0
            s = np.exp(np.sum(logp[i][tokens] - old[i][tokens]) / tokens.sum())
            total += -min(s * adv[i], np.clip(s, 1 - low, 1 + high) * adv[i])
        return total / len(adv)
    total, count = 0.0, 0  # PPO's token ratio, DAPO's token-level sum and clip-higher bounds
    for i in range(len(adv)):
        for t in range(logp.shape[1]):
            if mask[i, t]:
                r = np.exp(logp[i, t] - old[i, t])
                total += -min(r * adv[i], np.clip(r, 1 - low, 1 + high) * adv[i])
                count += 1
    return total / count


@pytest.mark.parametrize("level,low,high", [("token", 0.2, 0.28), ("sequence", 0.2, 0.2), ("sequence", 0.1, 0.3)])
def test_policy_losses_match_the_papers_formulas(level, low, high):
    logp, old, adv, mask = _case()
    got, metrics = grpo_loss(torch.tensor(logp), torch.tensor(old), torch.tensor(adv), torch.tensor(mask), clip_eps=low,
                             clip_eps_high=high, ratio_level=level)
    assert got.item() == pytest.approx(_reference(logp, old, adv, mask, low, high, level), rel=1e-12)
    assert 0.0 <= metrics["clip_frac"].item() <= 1.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_gradient_is_the_formulas(level):
    logp, old, adv, mask = _case(batch=3, length=4, seed=3)
    x = torch.tensor(logp, requires_grad=True)

    def loss(lp):
        return grpo_loss(lp, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), clip_eps=0.2,
                         clip_eps_high=0.3, ratio_level=level)[0]

    assert torch.autograd.gradcheck(loss, (x,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("estimator,level,high", [
    ("rloo", "token", None), ("reinforce_pp", "token", None), ("grpo", "sequence", None), ("grpo", "token", 0.28),
])
def test_one_optimizer_step_lowers_each_loss(estimator, level, high):
    """A toy policy (free logits per position) trained on its own samples: one step lowers the loss."""
    torch.manual_seed(0)
    groups, k, length, vocab = 4, 4, 5, 11
    logits = torch.nn.Parameter(torch.randn(groups * k, length, vocab))
    targets = torch.randint(0, vocab, (groups * k, length))
    mask = torch.ones(groups * k, length)
    rewards = torch.tensor(RNG.normal(size=groups * k), dtype=torch.float32)
    adv = group_advantages(rewards, k, estimator=estimator)
    if estimator == "reinforce_pp":
        adv = (adv - adv.mean()) / (adv.std() + 1e-6)

    def loss() -> torch.Tensor:
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
        return grpo_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=high, ratio_level=level)[0]

    with torch.no_grad():
        old = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    assert lowered_by_one_step(logits, loss)


@pytest.mark.slow
def test_the_grpo_stage_runs_rloo_reinforce_pp_and_gspo_with_clip_higher(tmp_path):
    """The stage selects the methods by config (two steps each on a random policy, one process; the
    reinforce_pp step normalizes over the whole step's batch)."""
    from grpo_testing import RANDOM_DATA, grpo_config, random_policy, run_grpo, step_records
    from sft_testing import weights

    data, model = random_policy(tmp_path)
    start = weights(model)
    for name, method in {"rloo": {"advantage": "rloo"}, "reinforce_pp": {"advantage": "reinforce_pp"},
                         "gspo": {"ratio": "sequence", "clip_eps_high": 0.28}}.items():
        cfg = grpo_config(name, data=RANDOM_DATA, reward={"verifiers": ["grpo_testing:length_reward"]}, steps=2,
                          prompts_per_step=4, group_size=4, max_new_tokens=8, eval_prompts=4, lr=1e-3, **method)
        out = tmp_path / name
        run_grpo(cfg, data, model, out, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        records = step_records(out)
        assert len(records) == 2 and all(np.isfinite(r["loss"]) and 0.0 <= r["clip_frac"] <= 1.0 for r in records)
        trained = weights(out)
        assert any(not torch.equal(trained[k], start[k]) for k in start), name


@pytest.mark.slow
def test_async_collection_runs_ppo_with_dynamic_sampling(tmp_path):
    """The methods that change collection or training state beyond the loss (PPO's critic, dynamic sampling's
    extra draws) under async Ray generators: flat groups are drawn again, the critic trains, no batch is staler
    than the bound."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (pip install posttrain[ray])")
    from grpo_testing import RANDOM_DATA, grpo_config, random_policy, run_grpo, step_records

    data, model = random_policy(tmp_path)
    cfg = grpo_config("async-ppo", data=RANDOM_DATA, reward={"verifiers": ["grpo_testing:parity_reward"]}, steps=3,
                      prompts_per_step=4, group_size=2, max_new_tokens=8, eval_prompts=4, lr=1e-3, critic_lr=1e-3,
                      mode="async", generators=1, max_staleness=1, advantage="gae", dynamic_sampling=True,
                      max_resamples=2)
    out = tmp_path / "grpo"
    run_grpo(cfg, data, model, out, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    records = step_records(out)
    assert len(records) == 3 and all(r["value_loss"] > 0 and r["critic_grad_norm"] > 0 for r in records)
    assert sum(r["resampled_batches"] for r in records) > 0
    assert all(r["policy_version"] - r["generator_version"] <= 1 for r in records)


class ScriptedCollection(_Collection):
    """A collection whose prompt batches are given: dynamic sampling alone, without models or generators."""

    def __init__(self, draws: list[list[RolloutGroup]], max_resamples: int):
        super().__init__(None, None, torch.device("cpu"), {"dynamic_sampling": True, "max_resamples": max_resamples})
        self.draws = iter(enumerate(draws, start=1))

    def _draw(self) -> _Draw:
        ticket, groups = next(self.draws)
        return _Draw(groups, groups, version=ticket - 1, ticket=ticket, generate_s=1.0, wait_s=0.5)

    def _share(self, groups):
        return groups

    def _stats(self, groups):
        return rollout_stats(groups)


def test_dynamic_sampling_keeps_groups_with_signal_and_draws_again_until_the_step_is_full():
    first = _groups(np.array([1, 1, 0, 1, 0, 0, 1, 1], dtype=float), 2)  # flat, signal, flat, flat
    second = _groups(np.array([0, 1, 1, 1, 1, 0, 0, 0], dtype=float), 2)  # signal, flat, signal, flat
    third = _groups(np.array([1, 0, 1, 0, 1, 0, 1, 0], dtype=float), 2)  # all with signal
    unused = _groups(np.array([1, 0] * 4, dtype=float), 2)
    collection = ScriptedCollection([first, second, third, unused], max_resamples=3)
    step = collection.next()
    assert step.groups == [first[1], second[0], second[2], third[0]]  # in draw order, flat ones dropped
    assert collection.step_metrics() == {"resampled_batches": 2}
    assert (step.ticket, step.version, step.generate_s, step.wait_s) == (3, 0, 3.0, 1.5) and collection.ticket == 3
    assert step.stats["zero_signal_frac"] == 5 / 12  # over every group sampled, not the kept ones


def test_dynamic_sampling_stops_at_its_bound_and_fills_the_step_with_flat_groups():
    draws = [_groups(np.array([1, 0, 1, 1, 1, 1, 1, 1], dtype=float), 2), *(_groups(np.ones(8), 2) for _ in range(3))]
    collection = ScriptedCollection(draws, max_resamples=2)
    step = collection.next()
    assert collection.step_metrics() == {"resampled_batches": 2} and step.ticket == 3  # the fourth batch is never drawn
    assert step.groups[0] is draws[0][0] and [informative(g) for g in step.groups] == [True, False, False, False]
    assert step.groups[1:] == draws[0][1:]  # filled with the first flat groups: zero advantage, the step keeps its size


def _rows(batch: int, length: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """A mask of one contiguous completion per row (start, end), of varying places and lengths."""
    mask, spans = np.zeros((batch, length), dtype=bool), []
    for b in range(batch):
        start = int(RNG.integers(0, length - 2))
        end = int(RNG.integers(start + 1, length + 1))
        mask[b, start:end] = True
        spans.append((start, end))
    return mask, spans


def test_gae_matches_the_papers_recursion():
    """Schulman et al. 2016: delta_t = r_t + gamma V_{t+1} - V_t, A_t = sum_l (gamma lambda)^l delta_{t+l}; reward at the end."""
    batch, length, gamma, lam = 5, 9, 0.97, 0.9
    mask, spans = _rows(batch, length)
    values, rewards = RNG.normal(size=(batch, length)), RNG.normal(size=batch)
    got_adv, got_ret = gae(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), gamma, lam)
    for b, (start, end) in enumerate(spans):
        v = list(values[b, start:end]) + [0.0]
        r = [0.0] * (end - start - 1) + [rewards[b]]
        deltas = [r[t] + gamma * v[t + 1] - v[t] for t in range(end - start)]
        for t in range(end - start):
            expected = sum((gamma * lam) ** l * deltas[t + l] for l in range(end - start - t))
            assert got_adv[b, start + t].item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
            assert got_ret[b, start + t].item() == pytest.approx(expected + v[t], rel=1e-12, abs=1e-12)
        assert not got_adv[b, :start].any() and not got_adv[b, end:].any()


def test_clipped_value_loss_and_whitening_match_their_formulas():
    batch, length, clip = 4, 6, 0.2
    mask, _ = _rows(batch, length)
    values, old, returns = (RNG.normal(size=(batch, length)) for _ in range(3))
    loss, metrics = clipped_value_loss(torch.tensor(values), torch.tensor(old), torch.tensor(returns),
                                       torch.tensor(mask), clip, denominator=10.0)
    total = 0.0
    for b in range(batch):
        for t in range(length):
            if mask[b, t]:
                clipped = old[b, t] + min(max(values[b, t] - old[b, t], -clip), clip)
                total += 0.5 * max((values[b, t] - returns[b, t]) ** 2, (clipped - returns[b, t]) ** 2)
    assert loss.item() == pytest.approx(total / 10.0, rel=1e-12)
    assert metrics["value_clip_frac"].item() == pytest.approx(np.mean(np.abs(values - old)[mask] > clip))
    adv = torch.tensor(values)
    kept = adv[torch.tensor(mask)]
    white = whiten(adv, torch.tensor(mask), float(kept.sum()), float(kept.square().sum()), kept.numel())
    assert white[torch.tensor(mask)].mean().item() == pytest.approx(0.0, abs=1e-12)
    assert white[torch.tensor(mask)].std(unbiased=False).item() == pytest.approx(1.0, rel=1e-6)


def test_token_advantages_equal_to_a_rows_advantage_give_the_rows_loss():
    logp, old = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    mask, adv = torch.ones(3, 5, dtype=torch.bool), torch.randn(3, dtype=torch.float64)
    row, _ = grpo_loss(logp, old, adv, mask)
    token, _ = grpo_loss(logp, old, adv[:, None].expand(3, 5), mask)
    assert token.item() == pytest.approx(row.item(), rel=1e-12)
    with pytest.raises(ValueError, match="one advantage per sequence"):
        grpo_loss(logp, old, adv[:, None].expand(3, 5), mask, ratio_level="sequence")


def test_one_optimizer_step_lowers_the_value_loss():
    torch.manual_seed(0)
    values = torch.nn.Parameter(torch.randn(4, 6))
    old, returns, mask = values.detach().clone(), torch.randn(4, 6), torch.ones(4, 6, dtype=torch.bool)
    assert lowered_by_one_step(values, lambda: clipped_value_loss(values, old, returns, mask, 0.5, 24.0)[0])
