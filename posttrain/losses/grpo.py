"""GRPO (Shao et al. 2024) and its relatives: group-relative advantages and a PPO-style clipped policy loss.

Advantage estimators (`group_advantages(..., estimator=)`), all from the rewards of each prompt's
group of K completions:
  * ``grpo``: reward minus the group mean, divided by the group's std (``std_normalize``; off, it
    is Dr. GRPO's unnormalized advantage);
  * ``rloo`` (Ahmadian et al. 2024): reward minus the mean of the *other* K - 1 rewards, i.e. the
    centred reward times K / (K - 1);
  * ``reinforce_pp`` (REINFORCE++ with a group baseline, Hu et al. 2025): the centred reward,
    normalized by the mean and std of the whole step's batch (`batch_normalize`, every rank's
    completions together) rather than per group.
Policy ratio (`grpo_loss(..., ratio_level=)`): per token, or per sequence as GSPO (Zheng et al.
2025): ``s = exp(mean_t(logp - old))``, clipped and weighted at the sequence level. Clipping may be
asymmetric (DAPO's clip-higher): ``clip(r, 1 - clip_eps, 1 + clip_eps_high)``.

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


ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
RATIO_LEVELS = ("token", "sequence")


def group_advantages(
    rewards: Tensor, group_size: int, std_normalize: bool = True, eps: float = 1e-6, estimator: str = "grpo"
) -> Tensor:
    """Advantages ``[num_groups * group_size]`` from each group's rewards (see the module docstring).

    ``grpo`` with ``std_normalize`` (GRPO as published) divides the centred rewards by the group's
    standard deviation (unbiased, as TRL) plus ``eps``; Dr. GRPO turns this off because it
    over-weights groups whose rewards barely vary. ``rloo`` scales them by K / (K - 1) (the
    leave-one-out baseline); ``reinforce_pp`` returns them centred only: `batch_normalize` then
    normalizes over the whole step.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if rewards.dim() != 1 or group_size < 2 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size >= 2; "
            f"got shape {tuple(rewards.shape)} and group_size={group_size}"
        )
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if estimator == "rloo":
        centred = centred * (group_size / (group_size - 1))
    elif estimator == "grpo" and std_normalize:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def batch_normalize(advantages: Tensor, total: float, total_sq: float, count: float, eps: float = 1e-6) -> Tensor:
    """REINFORCE++'s global normalization: ``(A - mean) / (std + eps)`` with the mean and (unbiased) std of the
    whole step's advantages, given as their sum, sum of squares and count over every rank."""
    mean = total / count
    var = max(total_sq - count * mean * mean, 0.0) / max(count - 1, 1)
    return (advantages - mean) / (var**0.5 + eps)


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
    clip_eps_high: float | None = None,
    ratio_level: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped-ratio policy loss, optional k3 KL penalty and truncated importance correction.

    Per token: ``-w * min(r A, clip(r, 1-eps, 1+eps) A) + kl_coef * k3`` (A the sequence's advantage,
    or the token's when `advantages` is `[B, T]`: PPO with a critic) with
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

    ``clip_eps_high`` (None: ``clip_eps``) is the upper clip bound (DAPO's clip-higher).
    ``ratio_level="sequence"`` (GSPO): one ratio per sequence, ``exp`` of the mean token log-ratio,
    clipped per sequence; the sequence's loss is ``-w min(s A, clip(s) A)`` plus its mean token KL,
    with ``w`` the truncated importance weight of the sequence (``exp`` of the mean token
    ``old - generator``, capped); the loss sums sequences over ``denominator`` (default: their count).

    Returns ``(loss, metrics)``; metrics are detached token means over the mask: ``clip_frac``
    (tokens whose gradient the clip removed), ``ratio/mean|min|max``, ``kl`` with a reference,
    ``tis/weight_mean`` and ``tis/truncated_frac`` with generator log-probs.
    """
    per_token_advantages = advantages.shape == logprobs.shape  # PPO's (GAE), one per token
    if not logprobs.shape == old_logprobs.shape == mask.shape or not (
            advantages.shape == logprobs.shape[:1] or per_token_advantages):
        raise ValueError(
            f"expected logprobs/old_logprobs/mask [B, T] and advantages [B] or [B, T]; got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(mask.shape)}, {tuple(advantages.shape)}"
        )
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    if ratio_level == "sequence" and per_token_advantages:
        raise ValueError("a sequence-level ratio (GSPO) takes one advantage per sequence, not per token")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    if ratio_level == "sequence":
        return _sequence_loss(logprobs, old_logprobs, advantages, mask, clip_eps, high, denominator, ref_logprobs,
                              kl_coef, generator_logprobs, tis_cap)
    mask = mask.to(logprobs.dtype)
    adv = advantages if per_token_advantages else advantages.unsqueeze(-1)
    ratio = torch.exp(logprobs - old_logprobs.detach())
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_eps, 1 + high) * adv
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
    clipped_away = ((ratio > 1 + high) & (adv > 0)) | ((ratio < 1 - clip_eps) & (adv < 0))
    kept = mask.bool()
    metrics["clip_frac"] = _masked_mean(clipped_away.to(mask.dtype), mask)
    metrics["ratio/mean"] = _masked_mean(ratio, mask)
    metrics["ratio/min"] = ratio.masked_fill(~kept, float("inf")).min()
    metrics["ratio/max"] = ratio.masked_fill(~kept, float("-inf")).max()
    return loss, metrics


def _sequence_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, low: float, high: float,
    denominator: float | Tensor | None, ref_logprobs: Tensor | None, kl_coef: float,
    generator_logprobs: Tensor | None, tis_cap: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: `grpo_loss` with one length-normalized ratio per sequence."""
    mask = mask.to(logprobs.dtype)
    lengths = mask.sum(-1).clamp(min=1)
    ratio = torch.exp(((logprobs - old_logprobs.detach()) * mask).sum(-1) / lengths)
    per_sequence = -torch.minimum(ratio * advantages, ratio.clamp(1 - low, 1 + high) * advantages)
    metrics: dict[str, Tensor] = {}
    if generator_logprobs is not None:
        raw_weight = torch.exp(((old_logprobs - generator_logprobs) * mask).sum(-1) / lengths).detach()
        weight = raw_weight.clamp(max=tis_cap)
        per_sequence = per_sequence * weight
        metrics["tis/weight_mean"] = weight.mean()
        metrics["tis/truncated_frac"] = (raw_weight > tis_cap).to(mask.dtype).mean()
    if ref_logprobs is not None:
        log_ref_ratio = ref_logprobs.detach() - logprobs
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        if kl_coef:
            per_sequence = per_sequence + kl_coef * (kl * mask).sum(-1) / lengths
        metrics["kl"] = _masked_mean(kl.detach(), mask)
    loss = per_sequence.sum() / (per_sequence.numel() if denominator is None else denominator)
    ratio = ratio.detach()
    clipped_away = ((ratio > 1 + high) & (advantages > 0)) | ((ratio < 1 - low) & (advantages < 0))
    metrics["clip_frac"] = clipped_away.to(mask.dtype).mean()
    metrics["ratio/mean"] = ratio.mean()
    metrics["ratio/min"] = ratio.min()
    metrics["ratio/max"] = ratio.max()
    return loss, metrics
