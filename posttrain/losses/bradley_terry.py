"""Bradley-Terry loss for reward models: the chosen completion should out-score the rejected one.

Under the Bradley-Terry model, P(chosen beats rejected) = sigmoid(r_chosen - r_rejected); the loss
is its negative log-likelihood, ``-log sigmoid(r_chosen - r_rejected - margin)``. A positive
``margin`` (Llama 2's per-pair preference strength) asks for a larger gap before the loss vanishes.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(
    chosen_rewards: Tensor, rejected_rewards: Tensor, margin: Tensor | float = 0.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean loss over pairs (all tensors ``[num_pairs]``, ``margin`` a scalar or per pair) and detached metrics.

    Metrics: ``accuracy`` (chosen strictly above rejected), ``margin`` (mean reward gap) and the
    mean chosen and rejected rewards.
    """
    if chosen_rewards.shape != rejected_rewards.shape:
        raise ValueError(f"chosen rewards {tuple(chosen_rewards.shape)} and rejected {tuple(rejected_rewards.shape)} differ in shape")
    gap = chosen_rewards - rejected_rewards
    loss = -F.logsigmoid(gap - margin).mean()
    gap = gap.detach()
    metrics = {
        "accuracy": (gap > 0).float().mean(),
        "margin": gap.mean(),
        "rewards/chosen": chosen_rewards.detach().mean(),
        "rewards/rejected": rejected_rewards.detach().mean(),
    }
    return loss, metrics
