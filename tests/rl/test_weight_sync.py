"""Every weight push is verified: the generator's weights against the trainer's by an exact checksum per tensor
(a push corrupted by one value stops GRPO with one line naming the tensor, sync in-process and async on Ray
actors), and on-policy batches' log-probs against the trainer's (`grpo.max_logprob_gap`). The vLLM engine's
read-back: tests/generation/test_backend_vllm.py."""

from __future__ import annotations

import pytest
import torch

from grpo_testing import RANDOM_DATA, grpo_config, random_policy, run_grpo, step_records
from posttrain.generation import NativeBackend
from posttrain.models import Transformer, preset_config
from posttrain.rl.weights import (CORRUPT_PUSH_ENV, WeightSyncError, check_digests, check_logprob_gap, verify_push,
                                  weights_digest)
from posttrain.utils.digest import tensor_digest

ENV = {"PYTHONPATH": "tests"}  # the stage imports grpo_testing's length_reward


def test_the_checksum_sees_one_changed_moved_or_recast_value():
    t = torch.randn(5, 7)
    changed, swapped = t.clone(), t.clone()
    changed[3, 2] = torch.nextafter(changed[3, 2], torch.tensor(10.0))  # one ulp
    swapped.view(-1)[[0, 1]] = swapped.view(-1)[[1, 0]]
    digests = {tensor_digest(x) for x in (t, changed, swapped, t.to(torch.bfloat16))}
    assert len(digests) == 4 and tensor_digest(t.clone()) == tensor_digest(t)
    assert tensor_digest(torch.tensor([-0.0, 1.0])) == tensor_digest(torch.tensor([0.0, 1.0]))  # read back by a kernel
    with pytest.raises(WeightSyncError, match=r"policy version 3: the generator's 'w' differs from the trainer's"):
        check_digests(weights_digest({"w": t}), weights_digest({"w": changed}), 3)
    with pytest.raises(WeightSyncError, match="has no tensor 'v'"):
        check_digests(weights_digest({"w": t, "v": t}), weights_digest({"w": t}), 1)


def test_a_push_is_checked_as_received_and_as_held_in_the_generators_dtype():
    model = Transformer(preset_config("tiny", vocab_size=64)).to(torch.bfloat16)
    backend = NativeBackend(model, pad_id=0)
    torch.manual_seed(1)
    weights = {name: t.float() + 0.01 * torch.randn(t.shape) for name, t in model.state_dict().items()}  # fp32 master
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    backend.update_weights(weights, 1)
    shapes = {name: tuple(t.shape) for name, t in weights.items()}
    verify_push(weights_digest(weights), weights, backend.held_digests(shapes), 1)  # held in bf16: compared cast
    torch.nn.init.zeros_(model.model.norm.weight)  # a load that went wrong after the push arrived intact
    with pytest.raises(WeightSyncError, match=r"policy version 1: the generator's 'model.norm.weight' differs .*\(1 of"):
        verify_push(weights_digest(weights), weights, backend.held_digests(shapes), 1)
    with pytest.raises(WeightSyncError, match="has no tensor 'extra.weight'"):
        verify_push(weights_digest({**weights, "extra.weight": torch.ones(2)}), {**weights, "extra.weight": torch.ones(2)},
                    backend.held_digests(shapes), 1)


def test_the_logprob_gap_bound_applies_to_on_policy_batches_only():
    check_logprob_gap(0.01, 0, 0.5, 4)
    check_logprob_gap(3.0, 1, 0.5, 4)  # a stale batch (async) may differ: another policy sampled it
    check_logprob_gap(3.0, 0, None, 4)
    with pytest.raises(WeightSyncError, match=r"policy version 4: .* by 0.9 on average \(grpo.max_logprob_gap: 0.5\)"):
        check_logprob_gap(0.9, 0, 0.5, 4)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_corrupted_weight_push_stops_grpo_with_one_line(mode, tmp_path):
    """async: the Ray actor finds the push differs, and the trainer stops with the actor's one line."""
    if mode == "async":
        pytest.importorskip("ray", reason="async GRPO needs Ray (pip install posttrain[ray])")
    data, policy = random_policy(tmp_path)
    cfg = grpo_config(f"{mode}-check", data=RANDOM_DATA, reward={"verifiers": ["grpo_testing:length_reward"]}, steps=3,
                      prompts_per_step=4, group_size=2, max_new_tokens=4, eval_prompts=2, checkpoint_every=100,
                      log_every=1, lr=1e-3, mode=mode, **({"generators": 1, "max_staleness": 0} if mode == "async" else {}))
    clean = run_grpo(cfg, data, policy, tmp_path / "clean", **ENV)
    assert clean.returncode == 0 and len(step_records(tmp_path / "clean")) == 3
    proc = run_grpo(cfg, data, policy, tmp_path / "bad", check=False, **ENV, **{CORRUPT_PUSH_ENV: "2"})
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("grpo: error: policy version 2: the generator's '") and "differs from the trainer's" in last
    assert "Traceback" not in proc.stderr and not (tmp_path / "bad").exists()
