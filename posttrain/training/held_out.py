"""Held-out passes during training: per-token means over a whole split, all data-parallel ranks together."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from posttrain.data.loader import Batch, Batches, at_least_one_row, to_device
from posttrain.losses.ce import num_loss_tokens
from posttrain.training.stats import data_parallel_sum, local_value


@torch.no_grad()
def held_out_means(
    model: nn.Module,
    batches: Batches,
    score: Callable[[Batch], Mapping[str, torch.Tensor]],
    keys: tuple[str, ...],
    mesh: DeviceMesh | None,
    device: torch.device,
) -> dict[str, float]:
    """Each of `score(batch)[key]` (sums over a batch's loss tokens) summed over the split, per loss token.

    `model` is in eval mode for the pass. Every rank runs every batch, with a stand-in row where
    the split's last batch leaves it none, so sharded forwards stay collective.
    """
    model.eval()
    totals, tokens = dict.fromkeys(keys, 0.0), 0
    for batch in batches:
        batch = to_device(at_least_one_row(batch), device)
        values = score(batch)
        for key in keys:
            totals[key] += float(local_value(values[key]))
        tokens += int(num_loss_tokens(batch["labels"]))
    model.train()
    *sums, tokens = data_parallel_sum([*totals.values(), tokens], mesh, device)
    return {key: value / max(tokens, 1) for key, value in zip(keys, sums)}
