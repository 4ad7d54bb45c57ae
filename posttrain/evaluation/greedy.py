"""Greedy accuracy: the one measure distillation's teacher/student comparison and GRPO's held-out curve share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from posttrain.evaluation.task_metrics import is_correct
from posttrain.generation import SamplingParams
from posttrain.generation.backend import GenerationBackend, NativeBackend
from posttrain.models import Transformer
from posttrain.parallel import data_parallel_rank
from posttrain.rewards.verifiers import load_verifiers, score
from posttrain.tokenizer import Tokenizer
from posttrain.training.stats import data_parallel_sum

GENERATION_BATCH = 64  # prompts per generate() call


Judge = Callable[[list[str], list[list[int]], list[dict[str, Any]]], Sequence[bool]]
"""(completion texts, prompt + completion ids, rows) -> which completions are correct."""


def verifier_judge(verifier: str) -> Judge:
    """The judge of one `reward.verifiers` name: the completions it scores correct."""
    verifiers = load_verifiers([verifier])
    return lambda texts, sequences, examples: [is_correct(s, verifier) for s in score(texts, examples, verifiers)]


@torch.no_grad()
def greedy_accuracy(
    backend: GenerationBackend,
    tokenizer: Tokenizer,
    prompts: Sequence[list[int]],
    examples: Sequence[dict[str, Any]],
    judge: Judge,
    max_new_tokens: int,
    mesh: DeviceMesh | None,
    device: torch.device,
) -> float:
    """Share of prompts whose greedy completion `judge` accepts: this rank's `prompts`, every rank's counted."""
    correct = 0
    if prompts:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=tokenizer.eos_ids)
        out = backend.generate(list(prompts), params, seed=0)
        sequences = [list(p) + list(c) for p, c in zip(prompts, out.tokens)]
        correct = sum(judge(tokenizer.decode_batch(out.tokens), sequences, list(examples)))
    total_correct, total = data_parallel_sum([correct, len(prompts)], mesh, device)
    return total_correct / max(total, 1)


def model_greedy_accuracy(model: Transformer, prompts: Sequence[list[int]], examples: Sequence[dict[str, Any]],
                          tokenizer: Tokenizer, verifier: str, max_new_tokens: int, mesh: DeviceMesh | None,
                          device: torch.device) -> float:
    """`greedy_accuracy` of a model (not sharded) under one verifier, the data-parallel ranks splitting `prompts`."""
    dp_rank, dp_size = data_parallel_rank(mesh)
    backend = NativeBackend(model, tokenizer.pad_id, max_batch_size=GENERATION_BATCH)
    return greedy_accuracy(backend, tokenizer, prompts[dp_rank::dp_size], examples[dp_rank::dp_size],
                           verifier_judge(verifier), max_new_tokens, mesh, device)
