"""PPO's critic side: generalized advantage estimation and the clipped value loss, on token grids.

Tensors are `[B, T]` over the training rows' positions (`posttrain.rl.batch`): position t holds
the value of the state that predicts `targets[t]`, and `mask` marks the completion's positions,
one contiguous run per row. A completion's reward is paid at its last token (a verifier scores
the finished answer), so every other step has reward 0.
"""

from __future__ import annotations

import torch
from torch import Tensor


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """(advantages, returns) `[B, T]` of completions whose reward `rewards` `[B]` comes at their last token.

    ``delta_t = r_t + gamma V_{t+1} - V_t`` (V after the last token is 0, the episode ends) and
    ``A_t = delta_t + gamma lam A_{t+1}`` (Schulman et al. 2016); returns are ``A_t + V_t``.
    Zero outside `mask`.
    """
    mask = mask.to(values.dtype)
    values = values * mask
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask.bool(), positions, -1).max(-1).values
    step_rewards = torch.zeros_like(values)
    has_tokens = last >= 0
    step_rewards[has_tokens, last[has_tokens]] = rewards[has_tokens].to(values.dtype)
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in range(values.shape[1] - 1, -1, -1):
        following = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(running)
        delta = step_rewards[:, t] + gamma * following - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * mask


def whiten(advantages: Tensor, mask: Tensor, total: float, total_sq: float, count: float, eps: float = 1e-8) -> Tensor:
    """Advantages shifted and scaled to mean 0, std 1 over a step's tokens (given as sums over every rank)."""
    mean = total / max(count, 1)
    std = max(total_sq / max(count, 1) - mean**2, 0.0) ** 0.5
    return (advantages - mean) / (std + eps) * mask.to(advantages.dtype)


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float,
                       denominator: float | Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """``0.5 max((V - G)^2, (V_old + clip(V - V_old, -c, c) - G)^2)`` summed over `mask`, over `denominator`.

    The clip keeps one update from moving a value estimate further than `clip` from the one the
    advantages were computed with (PPO's value clipping, as in OpenAI's baselines).
    """
    mask = mask.to(values.dtype)
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    loss = (per_token * mask).sum() / denominator
    count = mask.sum().clamp(min=1)
    metrics = {
        "value_clip_frac": (((values - old_values).abs() > clip).to(mask.dtype) * mask).sum().detach() / count,
        "value_mean": (values.detach() * mask).sum() / count,
    }
    return loss, metrics
