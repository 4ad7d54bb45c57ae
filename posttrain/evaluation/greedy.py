"""Greedy accuracy: the one measure distillation's teacher/student comparison and GRPO's held-out curve share."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from posttrain.generation import SamplingParams
from posttrain.generation.backend import NativeBackend
from posttrain.models import Transformer
from posttrain.parallel import data_parallel_rank
from posttrain.rewards.verifiers import Rewards
from posttrain.rollouts import GENERATION_BATCH, Sample, Sampler, verifier_values
from posttrain.tokenizer import Tokenizer
from posttrain.training.stats import data_parallel_sum

Judge = Callable[[list[Sample], list[dict[str, Any]]], Sequence[bool]]
"""(samples, their rows) -> which samples are correct."""


@torch.no_grad()
def greedy_accuracy(
    sampler: Sampler,
    prompts: Sequence[list[int]],
    examples: Sequence[Mapping[str, Any]],
    judge: Judge,
    max_new_tokens: int,
    mesh: DeviceMesh | None,
    device: torch.device,
) -> float:
    """Share of prompts whose greedy sample (an episode, with an environment) `judge` accepts: this rank's
    `prompts`, every rank's counted."""
    correct = 0
    if prompts:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=sampler.tokenizer.eos_ids)
        correct = sum(judge(sampler.sample(prompts, examples, params, seed=0), [dict(e) for e in examples]))
    total_correct, total = data_parallel_sum([correct, len(prompts)], mesh, device)
    return total_correct / max(total, 1)


def model_greedy_accuracy(model: Transformer, prompts: Sequence[list[int]], examples: Sequence[dict[str, Any]],
                          tokenizer: Tokenizer, verifier: str, max_new_tokens: int, mesh: DeviceMesh | None,
                          device: torch.device) -> float:
    """`greedy_accuracy` of a model (not sharded) under one verifier, the data-parallel ranks splitting `prompts`."""
    dp_rank, dp_size = data_parallel_rank(mesh)
    sampler = Sampler(NativeBackend(model, tokenizer.pad_id, max_batch_size=GENERATION_BATCH), tokenizer)
    rewards = Rewards([verifier])

    def judge(samples: list[Sample], rows: list[dict[str, Any]]) -> list[bool]:
        return [rewards.correct(v) for v in verifier_values(rewards, samples, rows)]

    return greedy_accuracy(sampler, prompts[dp_rank::dp_size], examples[dp_rank::dp_size], judge, max_new_tokens,
                           mesh, device)
