"""Greedy accuracy of a model on the first rows of the `eval` split, data-parallel ranks splitting the prompts."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from posttrain.data.loader import prompt_batches
from posttrain.evaluation.scoring import is_correct
from posttrain.generation import SamplingParams
from posttrain.generation.backend import NativeBackend
from posttrain.models import Transformer
from posttrain.parallel import data_parallel_rank
from posttrain.rewards.verifiers import load_verifiers, score
from posttrain.tokenizer import Tokenizer
from posttrain.training.stats import data_parallel_sum

GENERATION_BATCH = 64  # prompts per generate() call


def first_eval_rows(data_dir: str, n: int, seed: int) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Prompt ids and verifier rows of the first `n` rows of the `eval` split, in data order."""
    batch = next(prompt_batches(data_dir, n, seed=seed, split="eval", shuffle=False, loop=False), None)
    if batch is None:
        raise ValueError(f"{data_dir}: the eval split is empty")
    return batch["prompt_ids"], batch["examples"]


@torch.no_grad()
def greedy_accuracy(
    sampler: Transformer,
    prompts: list[list[int]],
    examples: list[dict[str, Any]],
    tokenizer: Tokenizer,
    verifier: str,
    max_new_tokens: int,
    mesh: DeviceMesh | None,
    device: torch.device,
) -> float:
    """Share of `prompts` whose greedy completion `verifier` accepts; the data-parallel ranks split the prompts."""
    dp_rank, dp_size = data_parallel_rank(mesh)
    mine = list(range(dp_rank, len(prompts), dp_size))
    correct = 0
    if mine:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=tokenizer.eos_ids)
        out = NativeBackend(sampler, tokenizer.pad_id, max_batch_size=GENERATION_BATCH).generate(
            [prompts[i] for i in mine], params, seed=0
        )
        scores = score(tokenizer.decode_batch(out.tokens), [examples[i] for i in mine], load_verifiers([verifier]))
        correct = sum(is_correct(s, verifier) for s in scores)
    total_correct, total = data_parallel_sum([correct, len(mine)], mesh, device)
    return total_correct / max(total, 1)
