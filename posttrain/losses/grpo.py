"""GRPO (Shao et al. 2024): group-relative advantages and a PPO-style clipped policy loss.

The loss works on per-token log-probs ``[B, T]`` (B sequences, T response positions), which the
caller computes chunk by chunk with ``posttrain.losses.logprobs``; it never sees logits.
Rows are laid out group by group: sequences ``g*K .. g*K+K-1`` answer prompt ``g``.

Three policies are involved per token:
  * ``logprobs``: the policy being trained (carries gradients);
  * ``old_logprobs``: the policy the PPO ratio is taken against, the trainer's own log-probs
    before this rollout batch's first update (constant across inner epochs);
  * ``generator_logprobs`` (optional): what the sampler (vLLM, or a stale policy version in async
    mode) actually sampled from. Numerics or staleness make it differ from ``old_logprobs``; the
    truncated importance weight ``min(exp(old - gen), cap)`` (Yao et al. 2025, "truncated
    importance sampling") corrects the policy-gradient term for that off-policyness while
    bounding its variance.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(
    rewards: Tensor, group_size: int, std_normalize: bool = True, eps: float = 1e-6
) -> Tensor:
    """Advantages ``[num_groups * group_size]``: rewards minus their group mean.

    With ``std_normalize`` (GRPO as published) the centred rewards are divided by the group's
    standard deviation (unbiased, as TRL) plus ``eps``; Dr. GRPO turns this off because it
    over-weights groups whose rewards barely vary.
    """
    if rewards.dim() != 1 or group_size < 2 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size >= 2; "
            f"got shape {tuple(rewards.shape)} and group_size={group_size}"
        )
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if std_normalize:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
    token_level: bool = True,
    denominator: float | Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    generator_logprobs: Tensor | None = None,
    tis_cap: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped-ratio policy loss, optional k3 KL penalty and truncated importance correction.

    Per token: ``-w * min(r A, clip(r, 1-eps, 1+eps) A) + kl_coef * k3`` with
    ``r = exp(logprobs - old_logprobs)``, ``w`` the truncated importance weight (1 without
    ``generator_logprobs``) and ``k3 = exp(ref - logp) - (ref - logp) - 1`` (Schulman's unbiased,
    non-negative KL estimator; only with ``ref_logprobs``).

    Normalization:
      * ``token_level=True`` (DAPO, Dr. GRPO): sum over every response token of the batch divided
        by ``denominator``, by default the batch's token count, so long answers weigh by their
        tokens. Pass the token count of the whole optimizer step (all micro-batches and ranks)
        for exact gradient accumulation, or a constant (Dr. GRPO: generation budget times the
        number of sequences) to remove the length bias entirely.
      * ``token_level=False`` (GRPO as published): mean over each sequence's tokens, then sum over
        sequences divided by ``denominator``, by default the number of sequences.

    Returns ``(loss, metrics)``; metrics are detached token means over the mask: ``clip_frac``
    (tokens whose gradient the clip removed), ``ratio/mean|min|max``, ``kl`` with a reference,
    ``tis/weight_mean`` and ``tis/truncated_frac`` with generator log-probs.
    """
    if not logprobs.shape == old_logprobs.shape == mask.shape or advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"expected logprobs/old_logprobs/mask [B, T] and advantages [B]; got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(mask.shape)}, {tuple(advantages.shape)}"
        )
    mask = mask.to(logprobs.dtype)
    adv = advantages.unsqueeze(-1)
    ratio = torch.exp(logprobs - old_logprobs.detach())
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)

    metrics: dict[str, Tensor] = {}
    if generator_logprobs is not None:
        raw_weight = torch.exp(old_logprobs - generator_logprobs).detach()
        weight = raw_weight.clamp(max=tis_cap)
        per_token = per_token * weight
        metrics["tis/weight_mean"] = _masked_mean(weight, mask)
        metrics["tis/truncated_frac"] = _masked_mean((raw_weight > tis_cap).to(mask.dtype), mask)
    if ref_logprobs is not None:
        log_ref_ratio = ref_logprobs.detach() - logprobs
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        if kl_coef:
            per_token = per_token + kl_coef * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)

    if token_level:
        total = (per_token * mask).sum()
        loss = total / (mask.sum().clamp(min=1) if denominator is None else denominator)
    else:
        per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        loss = per_sequence.sum() / (per_sequence.numel() if denominator is None else denominator)

    ratio = ratio.detach()
    clipped_away = ((ratio > 1 + clip_eps) & (adv > 0)) | ((ratio < 1 - clip_eps) & (adv < 0))
    kept = mask.bool()
    metrics["clip_frac"] = _masked_mean(clipped_away.to(mask.dtype), mask)
    metrics["ratio/mean"] = _masked_mean(ratio, mask)
    metrics["ratio/min"] = ratio.masked_fill(~kept, float("inf")).min()
    metrics["ratio/max"] = ratio.masked_fill(~kept, float("-inf")).max()
    return loss, metrics
