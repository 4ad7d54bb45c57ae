"""Async GRPO (Ray generators) killed and resumed ends where the uninterrupted run ends, bitwise.

Each case runs once uninterrupted and once as a chain of kills: SIGKILL after step 3 (just before the
checkpoint at 4: the rerun resumes from step 2), SIGKILL after step 4 (right after that checkpoint), then
the rest. At both checkpoints the generators hold work in flight, sampled by policy versions older than the
trainer's; the resumed runs must sample those tickets again with exactly those versions' weights. The
cases: staleness bound 1 and 2 over two generators (with 2, the newest checkpoint's generator weights are then
damaged on disk: the last rerun falls back to the checkpoint before it, and still ends bitwise), DAPO's dynamic sampling (extra draws per step) with
PPO (the critic) in one run, two trainer processes, and multi-turn episodes (guess-the-number: a ticket in
flight is a whole episode, sampled again turn by turn with its version's weights; the environment is
deterministic, so the resumed trajectories are the killed run's). About a minute each on 2 cores (mostly the
processes' and Ray's start, four runs per case).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_testing import GAME_DATA, GUESS_NUMBER, RANDOM_DATA, grpo_config, random_policy, run_grpo, turn_ending_policy
from sft_testing import ROOT, weights
from posttrain.training.checkpointer import resume_dir

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                reason="ray is not installed (pip install posttrain[ray])")

STEPS, EVERY = 6, 2
KILLS = (3, 4)  # just before the checkpoint at 4 (resumes from 2), right after it (resumes from 4)
TIMING = {"generate_s", "train_s", "step_s", "samples_per_s", "trainer_idle_frac", "peak_memory_mb"}
CASES: dict[str, dict[str, Any]] = {
    "staleness-1": {"max_staleness": 1},
    "staleness-2": {"max_staleness": 2, "damage": True},
    "dynamic-sampling-ppo": {"max_staleness": 1, "dynamic_sampling": True, "max_resamples": 2, "advantage": "gae",
                             "critic_lr": 1e-3},
    "two-trainers": {"max_staleness": 2, "nproc": 2},
    "multi-turn": {"max_staleness": 1, "environment": GUESS_NUMBER},
}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return random_policy(tmp_path_factory.mktemp("async-resume-policy"))


@pytest.fixture(scope="module")
def game_policy(tmp_path_factory):
    return turn_ending_policy(tmp_path_factory.mktemp("async-resume-game-policy"))


def records(out: Path) -> list[dict[str, Any]]:
    """Every metrics record of a finished run (the starting eval, the steps, the final eval), timings left out."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def in_flight(out: Path) -> tuple[int, list[tuple[int, int]], list[str]]:
    """(step, in-flight (ticket, version) pairs, saved generator weights) of the checkpoint a killed run left."""
    checkpoint = max(p for p in resume_dir(out).iterdir() if p.name.startswith("step-"))  # the newest of those kept
    state = json.loads((checkpoint / "rank-0.json").read_text())["data"]["data"]
    saved = sorted(p.name for p in (checkpoint / "generator-weights").glob("*.pt"))
    return int(checkpoint.name.split("-")[1]), [tuple(x) for x in state.get("in_flight", [])], saved


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_killed_async_run_resumes_to_the_uninterrupted_runs_weights_and_metrics(case, request, tmp_path):
    settings = dict(CASES[case])
    nproc, environment = settings.pop("nproc", 1), settings.pop("environment", None)
    damaged = settings.pop("damage", False)
    staleness, dynamic = settings["max_staleness"], settings.get("dynamic_sampling", False)
    # parity_reward leaves some groups flat (dynamic sampling draws again); length_reward varies in every group;
    # episodes: the game's reward and `format`
    verifiers = (["environment", "format"] if environment else
                 ["grpo_testing:parity_reward" if dynamic else "grpo_testing:length_reward"])
    data, model = request.getfixturevalue("game_policy" if environment else "policy")
    cfg = grpo_config(case, data=GAME_DATA if environment else RANDOM_DATA, reward={"verifiers": verifiers},
                      steps=STEPS, checkpoint_every=EVERY, prompts_per_step=4, group_size=2, max_new_tokens=8,
                      eval_prompts=4, lr=1e-3, mode="async", generators=2, environment=environment, **settings)
    env = {"PYTHONPATH": str(ROOT / "tests")}
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run_grpo(cfg, data, model, whole, nproc=nproc, **env)

    outputs, checkpoints = [], []
    for step in KILLS:
        proc = run_grpo(cfg, data, model, killed, check=False, nproc=nproc, POSTTRAIN_TEST_SIGKILL_AT_STEP=str(step),
                        **env)
        assert proc.returncode != 0 and not killed.exists(), proc.stderr[-3000:]
        outputs.append(proc.stdout)
        checkpoints.append(in_flight(killed))
    if damaged:  # the newest checkpoint's weights of an in-flight version flipped on disk: resumed from the one before
        newest = resume_dir(killed) / f"step-{2 * EVERY:08d}"
        weights_file = sorted((newest / "generator-weights").glob("*.pt"))[0]
        data_bytes = bytearray(weights_file.read_bytes())
        data_bytes[len(data_bytes) // 2] ^= 0xFF
        weights_file.write_bytes(bytes(data_bytes))
    outputs.append(run_grpo(cfg, data, model, killed, nproc=nproc, **env).stdout)

    # The resumed run ends with the uninterrupted run's weights and logged the same steps, bitwise.
    a, b = weights(whole), weights(killed)
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    expected, got = records(whole), records(killed)
    assert [r["step"] for r in got] == [r["step"] for r in expected] == [0, *range(1, STEPS + 1), STEPS]
    for want, have in zip(expected, got):
        assert have == want, (have["step"], {k: (want.get(k), have.get(k)) for k in want if want.get(k) != have.get(k)})

    # What the test guards happened: it trained, it resumed from checkpoints with work in flight sampled by
    # older policy versions, whose weights the checkpoints kept.
    start = weights(model)
    assert any(not torch.equal(start[k], a[k]) for k in start)
    assert "resuming from" not in outputs[0]
    assert f"at step {EVERY}" in outputs[1]
    if damaged:
        assert f"checkpoint step-{2 * EVERY:08d} is damaged: {weights_file}: its bytes differ" in outputs[2]
        assert f"at step {EVERY}" in outputs[2]
    else:
        assert f"at step {2 * EVERY}" in outputs[2]
    assert [step for step, _, _ in checkpoints] == [EVERY, 2 * EVERY]
    steps = [r for r in expected if "samples" in r]
    for step, flight, saved in checkpoints:
        assert flight and all(version < step for _, version in flight), flight
        assert saved == [f"version-{v:08d}.pt" for v in sorted({v for _, v in flight if v > 0})]
        if not dynamic:  # ticket t is sampled by version max(0, t - 1 - staleness)
            assert flight == [(t, max(0, t - 1 - staleness)) for t in range(step + 1, step + 1 + staleness)]
    assert max(r["reward_std"] for r in steps) > 0
    if dynamic:
        assert sum(r["resampled_batches"] for r in steps) > 0
        assert all(r["staleness"] <= staleness for r in steps) and max(r["staleness"] for r in steps) == staleness
    else:
        assert [r["staleness"] for r in steps] == [min(s, staleness) for s in range(STEPS)]
    if environment:  # the episodes ran several turns, in the killed runs as in the whole one
        assert all(r["turns_mean"] > 1.5 for r in steps), [r["turns_mean"] for r in steps]
    if settings.get("advantage") == "gae":
        assert all(r["value_loss"] > 0 for r in steps)
