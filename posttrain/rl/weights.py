"""The trainer's weights as generators need them: full tensors in HF names, on CPU, LoRA adapters merged."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from posttrain.models.lora import merged_state_dict
from posttrain.parallel import gather_full_state_dict
from posttrain.parallel.expert_parallel import gather_expert_states, uses_expert_parallel
from posttrain.utils.digest import HeldDigests, tensor_digest


def policy_weights(model: nn.Module, every_rank: bool) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights on CPU; collective under torch.distributed, every rank calls it.

    `every_rank=False` leaves them on rank 0 only (the async trainer sends them from there);
    `every_rank=True` gives each rank a copy (sync mode: every rank generates with its own copy).
    A LoRA/QLoRA policy's adapters are folded in (`merged_state_dict`): generators hold a plain model.
    """
    if not every_rank or not dist.is_initialized():
        state = gather_full_state_dict(model)
    else:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        experts = gather_expert_states(model, every_rank=True) if uses_expert_parallel(model) else {}
        state = {**{k: v.detach().cpu() for k, v in full.items()}, **experts}
    return merged_state_dict(model, state) if getattr(model, "lora_config", None) is not None else state


CORRUPT_PUSH_ENV = "POSTTRAIN_TEST_CORRUPT_PUSH"  # tests: corrupt the weights sent as this policy version


class WeightSyncError(RuntimeError):
    """A generator holds other weights than the trainer sent, or samples far from the trainer's policy."""


def weights_digest(state: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """`tensor_digest` of every tensor: what the trainer sends beside a push."""
    return {name: tensor_digest(t) for name, t in state.items()}


def check_digests(sent: Mapping[str, int], held: Mapping[str, int], version: int) -> None:
    """Raise `WeightSyncError` naming the first tensor the generator holds differently from what the trainer sent."""
    missing = sorted(set(sent) - set(held))
    if missing:
        raise WeightSyncError(f"policy version {version}: the generator has no tensor {missing[0]!r} the trainer sent")
    wrong = [name for name in sent if sent[name] != held[name]]
    if wrong:
        raise WeightSyncError(f"policy version {version}: the generator's {wrong[0]!r} differs from the trainer's "
                              f"({len(wrong)} of {len(sent)} tensors); the weight push or load is broken")


def verify_push(sent: Mapping[str, int], received: Mapping[str, torch.Tensor], held: HeldDigests, version: int) -> None:
    """The push arrived as the trainer sent it (`sent`, the trainer's digests) and the generator samples with exactly
    it (`held`, read back from the generator): each received tensor, in the dtype the generator holds it in."""
    got = weights_digest(received)
    check_digests(sent, got, version)
    expected = {name: got[name] if name not in held or held[name][0] == t.dtype else tensor_digest(t.to(held[name][0]))
                for name, t in received.items()}
    check_digests(expected, {name: digest for name, (_, digest) in held.items()}, version)


def corrupted_for_test(weights: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """The weights with one value changed when `CORRUPT_PUSH_ENV` names `version` (tests of the check)."""
    if os.environ.get(CORRUPT_PUSH_ENV) != str(version):
        return weights
    name = next((n for n in sorted(weights) if ".layers." in n), sorted(weights)[0])  # not a tied embedding
    bad = weights[name].clone()
    bad.view(-1)[0] += 1.0
    return {**weights, name: bad}


def check_logprob_gap(gap_mean: float, staleness: int, limit: float | None, version: int) -> None:
    """A batch sampled with the trainer's own weights (staleness 0) must score its tokens as the trainer does, up to
    the engines' rounding: a mean |log-prob gap| over `limit` (`grpo.max_logprob_gap`) means the generator runs
    other weights or another model."""
    if limit is not None and staleness == 0 and gap_mean > limit:
        raise WeightSyncError(f"policy version {version}: the generator's token log-probs differ from the trainer's by "
                              f"{gap_mean:.3g} on average (grpo.max_logprob_gap: {limit}) on a batch sampled with the "
                              "trainer's own weights; the generator runs other weights")
