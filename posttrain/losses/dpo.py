"""Preference losses on per-sequence log-probs: sigmoid DPO (with label smoothing), IPO, SimPO, ORPO;
and KTO on unpaired completions (`kto_loss`).

Inputs are the summed log-probs of each completion's kept tokens and their token counts, as
returned by ``posttrain.losses.logprobs.sequence_logprobs``; all tensors are ``[num_pairs]``.
Each function returns ``(loss, metrics)``: the loss is the mean over pairs, the metrics are
detached batch means of the implicit rewards, the reward accuracy (chosen reward > rejected)
and the reward margin, plus the policy's average log-probs of chosen and rejected.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

PreferenceLossType = Literal["sigmoid", "ipo", "simpo", "orpo"]
REFERENCE_FREE = ("simpo", "orpo")  # losses that need no reference model
UNPAIRED = ("kto",)  # losses that train on unpaired completions, not pairs


def pair_reward_type(loss_type: str) -> str:
    """The pair loss whose metrics score held-out pairs by `loss_type`'s implicit reward.

    KTO's reward is DPO's, ``beta * (log pi - log pi_ref)``: its pairs are scored as sigmoid DPO's.
    """
    return "sigmoid" if loss_type in UNPAIRED else loss_type


def _metrics(
    chosen_rewards: Tensor, rejected_rewards: Tensor, policy_chosen: Tensor, policy_rejected: Tensor
) -> dict[str, Tensor]:
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracy": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margin": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": policy_chosen.detach().mean(),
        "logps/rejected": policy_rejected.detach().mean(),
    }


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Sigmoid DPO (Rafailov et al. 2023) on summed log-probs.

    With ``label_smoothing`` = eps > 0 this is conservative DPO: each preference label is taken
    to be flipped with probability eps, so the loss is
    ``-(1 - eps) log sigma(beta h) - eps log sigma(-beta h)``, with
    ``h = (pi_c - ref_c) - (pi_r - ref_r)``. Rewards are ``beta * (pi - ref)``.
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_rewards = beta * (policy_chosen - ref_chosen)
    rejected_rewards = beta * (policy_rejected - ref_rejected)
    logits = chosen_rewards - rejected_rewards
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return losses.mean(), _metrics(chosen_rewards, rejected_rewards, policy_chosen, policy_rejected)


def ipo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    beta: float = 0.1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """IPO (Azar et al. 2023): ``(h - 1/(2 beta))^2`` with beta the paper's tau.

    ``h`` is the log-ratio difference of *length-averaged* log-probs (TRL's convention): the
    regression target 1/(2 beta) is then on a per-token scale, independent of completion length.
    Rewards are ``beta * (avg pi - avg ref)``.
    """
    chosen_ratio = (policy_chosen - ref_chosen) / chosen_lengths.clamp(min=1)
    rejected_ratio = (policy_rejected - ref_rejected) / rejected_lengths.clamp(min=1)
    losses = (chosen_ratio - rejected_ratio - 1 / (2 * beta)) ** 2
    return losses.mean(), _metrics(beta * chosen_ratio, beta * rejected_ratio, policy_chosen, policy_rejected)


def simpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    beta: float = 2.0,
    gamma: float = 0.5,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SimPO (Meng et al. 2024), reference-free.

    The implicit reward is ``beta * average log-prob``; the loss is
    ``-log sigma(r_chosen - r_rejected - gamma)`` with ``gamma`` the target reward margin in reward
    units (as in the paper and TRL's ``simpo_gamma``). The paper uses beta around 2 to 10.
    """
    chosen_rewards = beta * policy_chosen / chosen_lengths.clamp(min=1)
    rejected_rewards = beta * policy_rejected / rejected_lengths.clamp(min=1)
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)
    return losses.mean(), _metrics(chosen_rewards, rejected_rewards, policy_chosen, policy_rejected)


def orpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    beta: float = 0.1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """ORPO (Hong et al. 2024), reference-free: the chosen NLL plus ``beta`` times the odds-ratio loss.

    With ``p = exp(average log-prob)`` of a completion and ``odds = p / (1 - p)``, the loss is
    ``-avg log p(chosen) - beta * log sigma(log odds(chosen) - log odds(rejected))`` (beta is the
    paper's lambda, TRL's ``beta``). ``log(1 - p)`` is taken as ``log(-expm1(avg log p))``, exact
    near p = 0 and finite up to p = 1 - 1e-6. Rewards are ``beta * avg log p``.
    """
    chosen = policy_chosen / chosen_lengths.clamp(min=1)
    rejected = policy_rejected / rejected_lengths.clamp(min=1)
    top = -1e-6  # an average log-prob of 0 would make the odds infinite

    def log_odds(avg: Tensor) -> Tensor:
        avg = avg.clamp(max=top)
        return avg - torch.log(-torch.expm1(avg))

    ratio = log_odds(chosen) - log_odds(rejected)
    losses = -chosen - beta * F.logsigmoid(ratio)
    metrics = _metrics(beta * chosen, beta * rejected, policy_chosen, policy_rejected)
    metrics["orpo/log_odds_ratio"] = ratio.detach().mean()
    return losses.mean(), metrics


def kto_reference_point(policy_mismatched: Tensor, ref_mismatched: Tensor, rows: int) -> Tensor:
    """KTO's z0: the policy's KL from the reference, estimated on mismatched completions, at least 0.

    `policy_mismatched` / `ref_mismatched` are summed over a step's `rows` (all micro-batches and
    ranks summed by the caller); no gradient flows through it, as in the paper.
    """
    return ((policy_mismatched - ref_mismatched).detach() / rows).clamp(min=0)


def kto_loss(
    policy: Tensor,
    reference: Tensor,
    desirable: Tensor,
    z0: Tensor,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KTO (Ethayarajh et al. 2024) on unpaired completions, mean over rows.

    With ``r = log pi - log pi_ref`` of each row's completion and ``z0`` the reference point
    (`kto_reference_point`), a desirable row costs ``lambda_D (1 - sigma(beta (r - z0)))`` and an
    undesirable one ``lambda_U (1 - sigma(beta (z0 - r)))``: the value function of prospect
    theory, with the paper's (and TRL's) weights. Rewards are ``beta * r``; `rewards/accuracy` is
    the share of rows on their label's side of ``beta * z0``.
    """
    rewards = beta * (policy - reference)
    point = beta * z0
    good = desirable.bool()
    losses = torch.where(good, desirable_weight * (1 - torch.sigmoid(rewards - point)),
                         undesirable_weight * (1 - torch.sigmoid(point - rewards)))
    signed = torch.where(good, rewards - point, point - rewards).detach()
    metrics = {
        "kl": z0.detach(),
        "rewards/accuracy": (signed > 0).float().mean(),
        "rewards/margin": signed.mean(),
        "logps/completion": policy.detach().mean(),
    }
    return losses.mean(), metrics


def preference_loss(
    loss_type: PreferenceLossType,
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    ref_chosen: Tensor | None = None,
    ref_rejected: Tensor | None = None,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    chosen_nll_weight: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dispatch on the ``dpo.loss`` config value; reference log-probs are needed except for SimPO and ORPO.

    ``chosen_nll_weight`` > 0 adds that multiple of the chosen responses' per-token negative
    log-likelihood (RPO, Pang et al. 2024): preference losses can lower the chosen likelihood along
    with the rejected one, and with it the model's greedy answers; the NLL term holds it up.
    """
    if loss_type == "simpo":
        loss, metrics = simpo_loss(policy_chosen, policy_rejected, chosen_lengths, rejected_lengths, beta, simpo_gamma)
    elif loss_type == "orpo":
        loss, metrics = orpo_loss(policy_chosen, policy_rejected, chosen_lengths, rejected_lengths, beta)
    elif loss_type not in ("sigmoid", "ipo"):
        raise ValueError(f"dpo.loss must be one of sigmoid, ipo, simpo, orpo; got {loss_type!r}")
    elif ref_chosen is None or ref_rejected is None:
        raise ValueError(f"dpo.loss={loss_type} needs reference log-probs")
    elif loss_type == "sigmoid":
        loss, metrics = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, label_smoothing)
    else:
        loss, metrics = ipo_loss(
            policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_lengths, rejected_lengths, beta
        )
    nll = (-policy_chosen / chosen_lengths.clamp(min=1)).mean()
    metrics["nll/chosen"] = nll.detach()
    if chosen_nll_weight:
        loss = loss + chosen_nll_weight * nll
    return loss, metrics
