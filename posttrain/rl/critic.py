"""PPO's critic: a value model beside the policy, with its own optimizer, checkpointed with it.

The value model has the reward model's layout (the decoder and a scalar `score` head,
`posttrain.rewards.reward_model`) read at every position: ``V(s_t)`` for the state that predicts
token t. It starts from the policy's decoder (`grpo.critic_init: policy`, head drawn from the
run's seed) or from the reward stage's trained reward model (`reward_model`). Under data
parallelism it is sharded with FSDP2 like the policy, and its loss is scaled the same way
(`Optimization.backward`): each rank's loss is its tokens' share of the step's, FSDP2 averages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from posttrain.losses.ppo import clipped_value_loss
from posttrain.models import Transformer
from posttrain.optim import clip_grad_norm_
from posttrain.parallel import mesh_size, parallelize
from posttrain.rewards.reward_model import RewardModel, load_reward_model
from posttrain.training.faults import SettingError
from posttrain.training.setup import max_grad_norm



class ValueModel(RewardModel):
    """`RewardModel`'s parameters, its score read at every position."""

    def forward(self, input_ids: Tensor) -> Tensor:  # type: ignore[override]
        """Values `[B, S]` (float32) of every position of right-padded rows."""
        return self.score(Transformer.forward(self, input_ids)).squeeze(-1).float()

    def token_values(self, input_ids: Tensor) -> Tensor:
        return self(input_ids)  # through the module call: FSDP2's hooks gather the root's weights


class Critic:
    """The value model, its AdamW and the clipped value loss of `grpo`'s settings."""

    def __init__(self, model: ValueModel, grpo: Mapping[str, Any], replicas: int = 1):
        """`replicas`: the data-parallel ranks FSDP2 averages the critic's gradients over."""
        self.model = model.train()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=float(grpo["critic_lr"]), weight_decay=0.0)
        self.clip, self.max_grad_norm = float(grpo["value_clip"]), max_grad_norm(grpo)
        self.replicas = replicas

    @torch.no_grad()
    def values(self, input_ids: Tensor) -> Tensor:
        return self.model.token_values(input_ids)

    def backward(self, input_ids: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
                 denominator: float) -> dict[str, float]:
        """The value loss of one micro-batch (a share `denominator`, the step's tokens on every rank), back-propagated;
        summed over micro-batches and ranks, the metrics are the step's."""
        loss, metrics = clipped_value_loss(self.model.token_values(input_ids), old_values, returns, mask, self.clip,
                                           denominator)
        (loss * self.replicas).backward()
        return {"value_loss": float(loss.detach()), **{k: float(v) for k, v in metrics.items()}}

    def step(self) -> float:
        """One optimizer step on the accumulated gradients; returns their norm (before clipping)."""
        norm = clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


def build_critic(grpo: Mapping[str, Any], policy_dir: str, reward_model_dir: str | None, seed: int,
                 device: torch.device, mesh: DeviceMesh | None = None) -> Critic:
    """The critic `grpo.critic_init` asks for, sharded over `mesh`'s data-parallel ranks; a reward-model start
    needs the reward model's folder (the reward_model stage's output)."""
    init = grpo["critic_init"]
    if init == "reward_model" and reward_model_dir is None:
        raise SettingError("grpo.critic_init: reward_model needs a reward model (reward_model.source: train, which "
                           "passes --reward_model)")
    torch.manual_seed(seed)  # the value head of a policy start
    source = reward_model_dir if init == "reward_model" else policy_dir
    model = load_reward_model(source, device, model_class=ValueModel)
    if mesh is not None:
        parallelize(model, mesh, {})
    return Critic(model, grpo, mesh_size(mesh, "dp_replicate") * mesh_size(mesh, "dp_shard"))
