"""The GRPO stage end to end on CPU: it raises its sampled reward and keeps held-out accuracy (sync,
native sampler), async GRPO with Ray keeps every batch within the staleness bound and learns like sync,
a killed run resumes bitwise (also with dynamic sampling, and PPO with its critic), tensor parallelism matches
one process."""

from __future__ import annotations

import importlib.util
import pytest
import torch

from grpo_testing import RANDOM_DATA, grpo_config, random_policy, run_grpo, starting_policy, step_records, summary
from sft_testing import ROOT, weights
from posttrain.rewards import load_reward_model, save_reward_model
from posttrain.tokenizer import Tokenizer
from posttrain.training.checkpointer import resume_dir

# The test budget: the default grpo section (steps, prompts, group size, ...) with a smaller eval, at the
# lr for a partly solved starting policy (the default, 1e-4, is set for the pipeline's near-solved one).
LEARN = {"eval_prompts": 100, "lr": 3e-4}
# Margins from `python benchmarks/quality/learning_spread.py grpo` (seeds 1234, 1, 2 at 1 thread, seed 2 also at 2: identical; AMD EPYC
# with AVX-512, 2026-12-01): mean sampled reward over the last WINDOW steps minus the first 0.106-0.129;
# held-out greedy accuracy +0.04 to +0.18 (100 prompts; the old claim, >= +0.10, failed on a Xeon at +0.07).
WINDOW = 15  # steps
MIN_REWARD_GAIN = 0.05
MAX_ACCURACY_DROP = 0.03


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return starting_policy(tmp_path_factory.mktemp("grpo-start"))


@pytest.fixture(scope="module")
def sync_run(policy, tmp_path_factory):
    data, model = policy
    out = tmp_path_factory.mktemp("grpo-sync") / "grpo"
    run_grpo(grpo_config("sync", **LEARN), data, model, out)
    return out


def reward_rise(records: list[dict]) -> dict[str, float]:
    """Mean sampled reward over the first and the last WINDOW steps: GRPO's objective, measured on
    WINDOW x 128 samples each, far less noisy than greedy accuracy on 100 prompts."""
    rewards = [r["reward_mean"] for r in records]
    return {"reward_first": sum(rewards[:WINDOW]) / WINDOW, "reward_last": sum(rewards[-WINDOW:]) / WINDOW}


@pytest.mark.slow
@pytest.mark.timeout(1800)  # includes the module's starting SFT (~3 min) and the sync run
def test_sync_grpo_raises_its_sampled_reward_and_keeps_held_out_accuracy(sync_run):
    result, records = summary(sync_run), step_records(sync_run)
    rise = reward_rise(records)
    assert rise["reward_last"] - rise["reward_first"] >= MIN_REWARD_GAIN, rise
    assert result["eval_accuracy_after"] >= result["eval_accuracy_before"] - MAX_ACCURACY_DROP, result
    assert len(records) == result["steps"]
    keys = {"reward_mean", "reward_std", "pass_rate", "entropy", "clip_frac", "response_len", "policy_version",
            "generator_version", "staleness", "samples_per_s", "trainer_idle_frac", "logprob_gap_max"}
    assert keys <= records[0].keys()
    assert all(r["staleness"] == 0 and r["generator_version"] == step for step, r in enumerate(records))
    # Sync generation uses the trainer's weights: the sampler's log-probs are the trainer's.
    assert max(r["logprob_gap_max"] for r in records) < 1e-4
    assert not resume_dir(sync_run).exists()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_async_grpo_with_ray_stays_within_the_staleness_bound_and_learns_like_sync(policy, sync_run, tmp_path):
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (pip install posttrain[ray])")
    data, model = policy
    out = tmp_path / "grpo"
    run_grpo(grpo_config("async", mode="async", generators=2, max_staleness=1, **LEARN), data, model, out)
    records, result = step_records(out), summary(out)
    sync_records, sync_result = step_records(sync_run), summary(sync_run)
    assert len(records) == len(sync_records)
    staleness = [r["policy_version"] - r["generator_version"] for r in records]
    assert max(staleness) <= 1 and staleness.count(1) >= len(records) - 2  # overlapped, never beyond the bound
    assert records[-1]["dropped_batches"] == 0
    # Learning curve within noise of sync: mean reward over the second half and the final accuracy.
    half = len(records) // 2
    reward = sum(r["reward_mean"] for r in records[half:]) / (len(records) - half)
    sync_reward = sum(r["reward_mean"] for r in sync_records[half:]) / (len(sync_records) - half)
    assert abs(reward - sync_reward) <= 0.1, (reward, sync_reward)
    rise = reward_rise(records)
    assert rise["reward_last"] - rise["reward_first"] >= MIN_REWARD_GAIN, rise
    assert result["eval_accuracy_after"] >= result["eval_accuracy_before"] - MAX_ACCURACY_DROP, result
    assert abs(result["eval_accuracy_after"] - sync_result["eval_accuracy_after"]) <= 0.12


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_weights(policy, tmp_path):
    data, model = policy
    cfg = grpo_config("resume", steps=4, checkpoint_every=2, eval_prompts=4, prompts_per_step=4)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run_grpo(cfg, data, model, whole)
    proc = run_grpo(cfg, data, model, killed, check=False, POSTTRAIN_TEST_SIGKILL_AT_STEP="3")
    assert proc.returncode != 0 and not killed.exists() and resume_dir(killed).exists()
    proc = run_grpo(cfg, data, model, killed)
    assert "resuming from" in proc.stdout
    a, b = weights(whole), weights(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["reward_mean"] for r in step_records(whole)] == [r["reward_mean"] for r in step_records(killed)]


@pytest.mark.slow
def test_dynamic_sampling_draws_again_and_resumes_to_the_same_weights(policy, tmp_path):
    """The partly solved policy solves some prompts every time: their groups are dropped and refilled, and a
    killed run continues from the feed position the resampling left, not from the step count."""
    data, model = policy
    cfg = grpo_config("dynamic", steps=4, checkpoint_every=2, eval_prompts=4, prompts_per_step=4, group_size=4,
                      dynamic_sampling=True, max_resamples=2)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run_grpo(cfg, data, model, whole)
    records = step_records(whole)
    assert sum(r["resampled_batches"] for r in records) > 0
    assert records[-1]["ticket"] == len(records) + sum(r["resampled_batches"] for r in records)
    proc = run_grpo(cfg, data, model, killed, check=False, POSTTRAIN_TEST_SIGKILL_AT_STEP="3")
    assert proc.returncode != 0 and resume_dir(killed).exists()
    run_grpo(cfg, data, model, killed)
    a, b = weights(whole), weights(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["ticket"] for r in step_records(killed)] == [r["ticket"] for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2], ids=["one-process", "two-processes"])
def test_ppo_trains_its_critic_and_resumes_both_bitwise(nproc, tmp_path):
    """grpo.advantage gae: the critic's value loss is logged and stepped; a run killed after its checkpoint ends
    with the uninterrupted run's policy, which it can only reach with the critic's weights and Adam state restored
    (over two processes: the critic sharded with FSDP2, its resume state in each rank's shards)."""
    data, model = random_policy(tmp_path)
    cfg = grpo_config("ppo", data=RANDOM_DATA, reward={"verifiers": ["grpo_testing:length_reward"]}, steps=4,
                      checkpoint_every=2, prompts_per_step=4, group_size=2, max_new_tokens=8, eval_prompts=4,
                      advantage="gae", critic_lr=1e-3, lr=1e-3)
    env = {"PYTHONPATH": str(ROOT / "tests")}
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run_grpo(cfg, data, model, whole, nproc=nproc, **env)
    records = step_records(whole)
    assert all(r["value_loss"] > 0 and r["critic_grad_norm"] > 0 for r in records)
    proc = run_grpo(cfg, data, model, killed, check=False, nproc=nproc, POSTTRAIN_TEST_SIGKILL_AT_STEP="3", **env)
    assert proc.returncode != 0 and resume_dir(killed).exists()
    run_grpo(cfg, data, model, killed, nproc=nproc, **env)
    a, b = weights(whole), weights(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["value_loss"] for r in step_records(killed)] == [r["value_loss"] for r in records]
    cfg["grpo"]["critic_init"] = "reward_model"
    proc = run_grpo(cfg, data, model, tmp_path / "no-rm", check=False, **env)
    assert proc.returncode != 0 and "critic_init: reward_model needs a reward model" in proc.stderr + proc.stdout


@pytest.mark.slow
def test_a_reward_model_starts_the_critic_and_adds_its_weighted_score(tmp_path):
    """The reward_model stage's folder (`--reward_model`): PPO's critic starts from it and `grpo.rm_weight` adds its
    score to every sample's reward, so the sampled rewards differ from the verifier's alone."""
    data, model = random_policy(tmp_path)
    rm = tmp_path / "rm"
    torch.manual_seed(1)
    save_reward_model(load_reward_model(model), rm, Tokenizer(data / "tokenizer").pad_id, dtype=torch.float32)
    cfg = grpo_config("rm", data=RANDOM_DATA, reward={"verifiers": ["grpo_testing:length_reward"]}, steps=2,
                      checkpoint_every=2, prompts_per_step=4, group_size=2, max_new_tokens=8, eval_prompts=4,
                      advantage="gae", critic_init="reward_model", lr=1e-3)
    env = {"PYTHONPATH": str(ROOT / "tests")}
    run_grpo(cfg, data, model, tmp_path / "critic", reward_model=rm, **env)
    cfg["grpo"]["rm_weight"] = 0.5
    run_grpo(cfg, data, model, tmp_path / "weighted", reward_model=rm, **env)
    alone, weighted = step_records(tmp_path / "critic"), step_records(tmp_path / "weighted")
    assert all(r["value_loss"] > 0 for r in alone)
    # the same samples (step 1), another reward: rm_weight x the score standardized within each group (mean 0)
    assert "reward/rm" in weighted[0] and "reward/rm" not in alone[0]
    assert alone[0]["reward_std"] != weighted[0]["reward_std"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp", "cp"])
def test_tensor_and_context_parallel_match_one_process(layout, tmp_path):
    """TP=2 (vocabulary-sharded logits, sequence-parallel padding) or CP=2 (each rank half of every row), with
    the KL reference and two inner epochs."""
    data, model = random_policy(tmp_path)
    cfg = grpo_config("tp", data=RANDOM_DATA, reward={"verifiers": ["grpo_testing:length_reward"]}, steps=2,
                      prompts_per_step=4, group_size=4, max_new_tokens=8, eval_prompts=4, kl_coef=0.1, inner_epochs=2,
                      lr=1e-3)
    env = {"PYTHONPATH": str(ROOT / "tests")}
    run_grpo(cfg, data, model, tmp_path / "one", **env)
    cfg["parallel"][layout] = 2
    run_grpo(cfg, data, model, tmp_path / layout, nproc=2, **env)
    one, two = step_records(tmp_path / "one"), step_records(tmp_path / layout)
    for key in ("loss", "entropy", "kl", "grad_norm", "reward_mean"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=1e-4, abs=1e-6), key
    a, b = weights(tmp_path / "one"), weights(tmp_path / layout)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
