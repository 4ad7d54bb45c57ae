"""Context parallelism (`parallel.cp`): the sequence dimension sharded over the ranks of a `cp` mesh
dimension, which read the same batch.

- Load balance (head-tail): a row, padded to a multiple of 2 x cp, is cut into 2 x cp chunks, and rank
  r holds chunks r and 2 cp - 1 - r, so under the causal mask every rank attends over as many keys.
- The model (`apply_context_parallel`, a forward pre-hook: the model knows nothing of it) gets this
  rank's positions of the ids, position ids (computed on the whole row first, so RoPE and packed
  documents see their true positions) and, in place of the document ids, a `GatheredKV` mask: each
  layer gathers the keys and values of every rank along the sequence (Llama 3's all-gather context
  parallelism, not a ring: the keys and values of grouped-query attention are a small share of the
  activations) and its local queries attend over them with the document-causal mask of their global
  positions.
- The losses (`posttrain.losses.head.OutputHead`) shard the labels the same way and return whole-row
  results: sums all-reduced, per-token values gathered back into position order. Both are
  differentiable collectives, so a stage computes its loss and counts as without context parallelism.

Gradients: every rank of a `cp` group backpropagates the same whole-row loss, and the collectives'
backward sums the group's contributions, so each rank's gradient is cp times its shard's; FSDP2 shards
over `dp_shard` x `cp` and averages over both, which cancels the factor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_gather_tensor_autograd
from torch.distributed.device_mesh import DeviceMesh

from posttrain.models.attention import GatheredKV



class ContextParallel:
    """One `cp` group's sequence sharding: what each rank holds of a row, and the way back."""

    def __init__(self, mesh: DeviceMesh):
        self.size, self.rank, self.group = mesh.size(), mesh.get_local_rank(), mesh.get_group()

    def padded(self, seq: int) -> int:
        chunks = 2 * self.size
        return -(-seq // chunks) * chunks

    def positions(self, seq: int, device: torch.device, rank: int | None = None) -> Tensor:
        """The positions of a row of `seq` (padded) that `rank` (default: this one) holds."""
        rank = self.rank if rank is None else rank
        chunk = self.padded(seq) // (2 * self.size)
        head, tail = rank, 2 * self.size - 1 - rank
        return torch.cat([torch.arange(head * chunk, (head + 1) * chunk, device=device),
                          torch.arange(tail * chunk, (tail + 1) * chunk, device=device)])

    def _order(self, seq: int, device: torch.device) -> Tensor:
        """Where each padded position sits in the ranks' shards concatenated (rank 0's, rank 1's, ...)."""
        held = torch.cat([self.positions(seq, device, r) for r in range(self.size)])
        return torch.empty_like(held).scatter_(0, held, torch.arange(held.numel(), device=device))

    def shard(self, x: Tensor, fill: float | int) -> Tensor:
        """This rank's positions of `x` (`[B, S, ...]`), the row padded with `fill` first."""
        seq = x.shape[1]
        pad = self.padded(seq) - seq
        if pad:
            x = torch.cat([x, x.new_full((x.shape[0], pad, *x.shape[2:]), fill)], dim=1)
        return x.index_select(1, self.positions(seq, x.device))

    def gather(self, local: Tensor, seq: int, dim: int = 1) -> Tensor:
        """Every rank's `local` along `dim`, in position order, padding dropped (`seq` positions)."""
        whole = all_gather_tensor_autograd(local.contiguous(), gather_dim=dim, group=self.group)
        order = self._order(seq, local.device)[:seq]
        return whole.index_select(dim, order)

    def sum(self, x: Tensor) -> Tensor:
        """`x` summed over the group, differentiably (each rank's gradient the sum of the group's)."""
        return all_gather_tensor_autograd(x.unsqueeze(0).contiguous(), gather_dim=0, group=self.group).sum(0)

    def model_inputs(self, input_ids: Tensor, position_ids: Tensor | None,
                     document_ids: Tensor | None) -> dict[str, Any]:
        """The model's keyword inputs for this rank: its shard of the ids and positions, and the mask."""
        from posttrain.models.transformer import document_positions

        seq = input_ids.shape[1]
        documents = torch.zeros_like(input_ids) if document_ids is None else document_ids
        if position_ids is None:
            position_ids = document_positions(documents)
        position_ids = position_ids.expand_as(input_ids)
        full = self.padded(seq)
        # Padding is one more document: it attends to itself only, and its labels are ignored.
        documents = torch.cat([documents, documents.new_full((documents.shape[0], full - seq),
                                                             int(documents.max()) + 1)], dim=1)
        mine = self.positions(seq, input_ids.device)
        causal = mine[:, None] >= torch.arange(full, device=input_ids.device)[None, :]
        mask = (documents[:, mine, None] == documents[:, None, :]) & causal
        return {"input_ids": self.shard(input_ids, 0), "position_ids": self.shard(position_ids, 0),
                "document_ids": None, "attn_mask": GatheredKV(mask[:, None], lambda t: self.gather(t, full, dim=2))}


def _shard_model_inputs(cp: ContextParallel):
    def hook(module: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict[str, Any]]:
        kwargs = dict(kwargs)
        input_ids = args[0] if args else kwargs.pop("input_ids")
        if kwargs.get("kv_cache") is not None or kwargs.get("attn_mask") is not None:
            raise ValueError("parallel.cp shards whole rows: it takes no KV cache or attention mask (generation "
                             "runs on the generators' own copy of the weights)")
        kwargs.update(cp.model_inputs(input_ids, kwargs.pop("position_ids", None), kwargs.pop("document_ids", None)))
        return (), kwargs

    return hook


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> ContextParallel:
    """Shard every forward's rows over `cp_mesh` (its hidden states are this rank's positions)."""
    cp = ContextParallel(cp_mesh)
    model.register_forward_pre_hook(_shard_model_inputs(cp), with_kwargs=True)
    model.context_parallel = cp
    return cp
