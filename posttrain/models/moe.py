"""Mixture-of-experts feed-forward (Qwen3-MoE, Qwen2-MoE): top-k token routing over dense SwiGLU experts.

Parameter names are the checkpoints' (`mlp.gate.weight`, `mlp.experts.<e>.{gate,up,down}_proj.weight`),
so HF folders load as they are. Routing is token choice without capacity limits (no token is
dropped): softmax over the router logits in float32, the top `num_experts_per_tok`, optionally
renormalized (`norm_topk_prob`), each expert run on the tokens routed to it, outputs added in
expert order. Qwen2-MoE adds a shared expert every token takes, scaled by a sigmoid gate
(`mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`). The router logits of a forward are kept for the load-balancing loss
(`load_balancing_loss`), which the training stages add with the config's `router_aux_loss_coef`.

The experts see their tokens as one expert-sorted batch with a count per expert (`Experts.forward`),
the seam expert parallelism hooks into (`posttrain.parallel.expert_parallel`): it sends each
expert's rows to the rank holding it and the results back, and the layer never knows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Expert(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """A layer's experts, named by their index (`experts.<e>.*`, the checkpoints' names).

    Expert parallelism removes the ones another rank holds; `held` lists what is left, in order.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int):
        super().__init__()
        for e in range(num_experts):
            self.add_module(str(e), Expert(hidden, intermediate))
        self.num_experts = num_experts

    @property
    def held(self) -> list[int]:
        return [int(name) for name in self._modules]

    def forward(self, rows: Tensor, counts: Sequence[int]) -> Tensor:
        """`rows` sorted by expert, `counts[i]` of them for the i-th held expert; their outputs in that order.

        An expert no token chose still runs (on no rows): its weights get zero gradients, not none,
        so every data-parallel rank reduces the same gradients (FSDP2).
        """
        segments = rows.split(list(counts))
        return torch.cat([expert(x) for expert, x in zip(self._modules.values(), segments, strict=True)])


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 shared_intermediate: int = 0):
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(hidden, intermediate, num_experts)
        if shared_intermediate:
            self.shared_expert = Expert(hidden, shared_intermediate)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.router_logits: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)
        self.router_logits = logits
        weights, chosen = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # Every (token, slot) assignment, sorted by expert (stable: a token's rows stay in token order).
        order = chosen.reshape(-1).argsort(stable=True)
        tokens = order // self.top_k
        counts = torch.bincount(chosen.reshape(-1), minlength=self.experts.num_experts).tolist()
        outputs = self.experts(flat[tokens], counts)
        out = torch.zeros_like(flat)
        out.index_add_(0, tokens, outputs * weights.to(flat.dtype).reshape(-1)[order, None])
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view_as(x)


def load_balancing_loss(router_logits: Sequence[Tensor], num_experts: int, top_k: int) -> Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4-6) over every MoE layer's tokens pooled:
    ``E * sum_e f_e P_e``, `f_e` the share of top-k assignments to expert e, `P_e` its mean router probability.

    1 when routing is uniform; it grows as a few experts take the tokens. As transformers computes it
    (`load_balancing_loss_func` without an attention mask).
    """
    assignments = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    probability = torch.zeros_like(assignments)
    rows = 0
    for logits in router_logits:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        chosen = probs.topk(top_k, dim=-1).indices
        assignments = assignments + torch.bincount(chosen.reshape(-1), minlength=num_experts).float()
        probability = probability + probs.sum(dim=0)
        rows += logits.shape[0]
    return (assignments / rows * probability / rows).sum() * num_experts
