"""Sequence log-probs of preference pairs, for training steps and for whole-split scoring passes.

A pair's chosen and rejected rows go through the model as one ``[2b, L]`` batch (one forward,
one FSDP all-gather per block); the completion tokens are scored by the stage's `OutputHead`
(chunked by default, so the full-vocabulary logits of chosen and rejected are never held at once;
loss parallel under tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from tqdm.auto import tqdm

from posttrain.data.loader import to_device
from posttrain.losses.head import OutputHead
from posttrain.models import Transformer
from posttrain.parallel import data_parallel_rank

Collate = Callable[[dict[str, Any], np.ndarray], dict[str, Any]]


@dataclass
class PairLogps:
    """Summed completion log-probs (float32) and completion token counts of ``b`` pairs, ``[b]`` each."""

    chosen: Tensor
    rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor


def completion_logprobs(model: Transformer, head: OutputHead, input_ids: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Summed log-prob ``[B]`` of each row's labelled tokens and their count ``[B]``.

    Rows are right-padded, so causal attention alone keeps padding out of the real tokens.
    Call inside `head.context()` (and run `backward` there too).
    """
    return head.sequence_logprobs(model(input_ids), labels)


def pair_logprobs(model: Transformer, head: OutputHead, batch: Mapping[str, Tensor]) -> PairLogps:
    """Policy (or reference) log-probs of a preference batch's chosen and rejected completions."""
    n = batch["chosen_input_ids"].shape[0]
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    sums, counts = completion_logprobs(model, head, ids, labels)
    return PairLogps(sums[:n], sums[n:], counts[:n], counts[n:])


def reshard(model: torch.nn.Module) -> None:
    """Give every FSDP2 module its sharded parameters back after no-grad forwards.

    FSDP2 leaves the root (and the last block) unsharded after a forward, expecting a backward to
    reshard them; without one, `model.parameters()` would keep returning the gathered tensors (the
    wrong objects for an optimizer or a checkpoint) and their memory would stay allocated.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@torch.no_grad()
def score_pairs(
    model: Transformer,
    head: OutputHead,
    dataset: Any,
    collate: Collate,
    rows_per_rank: int,
    device: torch.device,
    desc: str,
    show_progress: bool = True,
) -> PairLogps:
    """Log-probs of every pair of `dataset` (a `posttrain.data.store.Split`), in row order, on CPU.

    Data-parallel ranks score disjoint slices of `rows_per_rank` rows and the results are summed
    over all processes, so every rank gets all rows. Each rank runs the same number of forwards
    (a short last slice is padded with row 0, whose result is discarded): FSDP2 needs every rank
    in every all-gather. Tensor-parallel peers score the same rows; the sum is divided by the
    number of processes that scored each row. `collate` is the preference collate of
    `posttrain.data.loader` (`Batches.collate`). Call with every rank.
    """
    n = len(dataset)
    rank, size = data_parallel_rank(head.mesh)
    totals = torch.zeros(n, 4, dtype=torch.float64)  # chosen, rejected, chosen tokens, rejected tokens
    seen = torch.zeros(n, dtype=torch.float64)
    per_pass = rows_per_rank * size
    was_training = model.training
    model.eval()
    for start in tqdm(range(0, n, per_pass), desc=desc, unit="batch", disable=not show_progress, mininterval=1.0):
        index = np.arange(start + rank * rows_per_rank, start + (rank + 1) * rows_per_rank)
        real = index[index < n]
        index = np.where(index < n, index, 0)
        with head.context():
            out = pair_logprobs(model, head, to_device(collate(dataset[index], index), device))
        k = len(real)
        if k:
            values = torch.stack([out.chosen, out.rejected, out.chosen_tokens.to(out.chosen.dtype),
                                  out.rejected_tokens.to(out.chosen.dtype)], dim=1)
            totals[torch.from_numpy(real)] += values[:k].double().cpu()
            seen[torch.from_numpy(real)] += 1
    model.train(was_training)
    reshard(model)
    if dist.is_initialized() and dist.get_world_size() > 1:
        packed = torch.cat([totals, seen[:, None]], dim=1).to(device)
        dist.all_reduce(packed)
        totals, seen = packed[:, :4].cpu(), packed[:, 4].cpu()
    totals /= seen.clamp(min=1)[:, None]
    return PairLogps(totals[:, 0].float(), totals[:, 1].float(), totals[:, 2].round().long(), totals[:, 3].round().long())
