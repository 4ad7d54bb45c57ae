"""One optimizer step of the DPO stage: pairs (sigmoid DPO, IPO, SimPO, ORPO) or KTO's unpaired rows.

A step takes the step's micro-batches of this rank, runs each forward and backward through the
stage's `Optimization`, and returns the step's metrics as means over every row of the step (all
micro-batches, all ranks). The optimizer step itself stays with the caller, so the stage and the
benchmarks run the very same code.

    step = preference_step(dpo_section, model, head, reference, optimization, mesh, device)
    record = step(batches)          # loss and the metrics named in step.metrics, per row of the step
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from posttrain.dpo.logprobs import PairLogps, completion_logprobs, pair_logprobs, reshard
from posttrain.losses.dpo import UNPAIRED, kto_loss, kto_reference_point, pair_reward_type, preference_loss
from posttrain.losses.head import OutputHead
from posttrain.models import Transformer
from posttrain.parallel import data_parallel_rank
from posttrain.training.optimization import Optimization
from posttrain.training.stats import data_parallel_sum, non_pad_tokens

PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin", "logps/chosen",
                "logps/rejected", "nll/chosen")
KTO_METRICS = ("kl", "rewards/accuracy", "rewards/margin", "logps/completion", "nll/chosen")
PER_TOKEN = ("ipo", "simpo", "orpo")  # losses that compare length-averaged log-probs

Reference = Callable[[Mapping[str, Tensor]], tuple[Tensor, Tensor]]
"""A batch -> the reference's (chosen, rejected) summed log-probs (precomputed or online)."""


def pair_loss(dpo: Mapping[str, Any], policy: PairLogps,
              ref: tuple[Tensor, Tensor] | None) -> tuple[Tensor, dict[str, Tensor]]:
    """`preference_loss` for `dpo.loss` (reference None for SimPO and ORPO; KTO's pairs by its implicit reward)."""
    ref_chosen, ref_rejected = ref if ref is not None else (None, None)
    return preference_loss(
        pair_reward_type(dpo["loss"]), policy.chosen, policy.rejected, policy.chosen_tokens, policy.rejected_tokens,
        ref_chosen, ref_rejected, beta=dpo["beta"], label_smoothing=dpo["label_smoothing"],
        simpo_gamma=dpo["simpo_gamma"], chosen_nll_weight=dpo["chosen_nll_weight"],
    )


def likelihood_accuracy(logps: PairLogps, per_token: bool) -> float:
    """Share of pairs whose chosen completion the model finds more likely (ties count as wrong)."""
    chosen, rejected = logps.chosen.double(), logps.rejected.double()
    if per_token:
        chosen, rejected = chosen / logps.chosen_tokens.clamp(min=1), rejected / logps.rejected_tokens.clamp(min=1)
    return float((chosen > rejected).double().mean())


class _Step:
    """What both steps share: the model and head, the reference, and the step's row means."""

    metrics: tuple[str, ...] = ()

    def __init__(self, dpo: Mapping[str, Any], model: Transformer, head: OutputHead, reference: Reference | None,
                 optimization: Optimization, mesh: DeviceMesh | None, device: torch.device, pad_id: int):
        self.dpo, self.model, self.head, self.reference = dpo, model, head, reference
        self.optimization, self.mesh, self.device, self.pad_id = optimization, mesh, device, pad_id
        self.dp_size = data_parallel_rank(mesh)[1]

    def __call__(self, batches: list[dict[str, Tensor]]) -> dict[str, float]:
        """Forward and backward over the step's micro-batches; the loss and `metrics` per row, and `useful_tokens`."""
        with self.head.context():
            refs = [self.reference(batch) if self.reference is not None else None for batch in batches]
        self.prepare(batches, refs)
        sums = dict.fromkeys(("loss", *self.metrics), 0.0)
        for batch, ref in zip(batches, refs):
            with self.head.context():
                loss, row_metrics = self.loss(batch, ref)
                # Each rank's mean over its rows, counted accum x dp times in the step: the mean over the step's rows.
                self.optimization.backward(loss, per=len(batches) * self.dp_size)
            rows = len(batch["chosen_input_ids"])
            sums["loss"] += float(loss.detach()) * rows
            for name in self.metrics:
                sums[name] += float(row_metrics[name]) * rows
        useful = sum(non_pad_tokens(b[f"{side}_input_ids"], self.pad_id) for b in batches for side in ("chosen", "rejected"))
        totals = data_parallel_sum([*sums.values(), useful], self.mesh, self.device)
        record = {name: value / self.dpo["batch_size"] for name, value in zip(sums, totals)}
        record["useful_tokens"] = totals[-1]
        return record

    def prepare(self, batches: list[dict[str, Tensor]], refs: list[tuple[Tensor, Tensor] | None]) -> None:
        """What the step measures over all its rows before any backward (KTO's reference point)."""

    def loss(self, batch: dict[str, Tensor], ref: tuple[Tensor, Tensor] | None) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError


class PairStep(_Step):
    """Sigmoid DPO, IPO, SimPO or ORPO on (chosen, rejected) pairs."""

    metrics = PAIR_METRICS

    def loss(self, batch: dict[str, Tensor], ref: tuple[Tensor, Tensor] | None) -> tuple[Tensor, dict[str, Tensor]]:
        return pair_loss(self.dpo, pair_logprobs(self.model, self.head, batch), ref)


class KTOStep(_Step):
    """KTO on unpaired rows (desirable or not), each stored with a mismatched completion for z0.

    z0 is measured over the whole step (every micro-batch and rank, without gradients) before its
    backward passes, so grad_accum and the process count leave it alone.
    """

    metrics = KTO_METRICS

    def prepare(self, batches: list[dict[str, Tensor]], refs: list[tuple[Tensor, Tensor] | None]) -> None:
        policy_sum = ref_sum = 0.0
        with torch.no_grad(), self.head.context():
            for batch, (_, ref_mismatched) in zip(batches, refs):
                mismatched, _ = completion_logprobs(self.model, self.head, batch["rejected_input_ids"],
                                                    batch["rejected_labels"])
                policy_sum += float(mismatched.double().sum())
                ref_sum += float(ref_mismatched.double().sum())
        reshard(self.model)
        policy_total, ref_total = data_parallel_sum([policy_sum, ref_sum], self.mesh, self.device)
        self.z0 = kto_reference_point(torch.tensor(policy_total), torch.tensor(ref_total), self.dpo["batch_size"])

    def loss(self, batch: dict[str, Tensor], ref: tuple[Tensor, Tensor] | None) -> tuple[Tensor, dict[str, Tensor]]:
        """KTO on a micro-batch's own completions, plus `chosen_nll_weight` times the desirable rows' NLL."""
        dpo = self.dpo
        policy, tokens = completion_logprobs(self.model, self.head, batch["chosen_input_ids"], batch["chosen_labels"])
        desirable = batch["desirable"]
        loss, metrics = kto_loss(policy, ref[0], desirable, self.z0.to(policy.device), beta=dpo["beta"],
                                 desirable_weight=dpo["desirable_weight"], undesirable_weight=dpo["undesirable_weight"])
        nll = torch.where(desirable, -policy / tokens.clamp(min=1), torch.zeros_like(policy)).sum() / len(policy)
        metrics["nll/chosen"] = nll.detach()
        return loss + dpo["chosen_nll_weight"] * nll, metrics


def preference_step(dpo: Mapping[str, Any], model: Transformer, head: OutputHead, reference: Reference | None,
                    optimization: Optimization, mesh: DeviceMesh | None, device: torch.device,
                    pad_id: int) -> PairStep | KTOStep:
    """The step `dpo.loss` trains with."""
    kind = KTOStep if dpo["loss"] in UNPAIRED else PairStep
    return kind(dpo, model, head, reference, optimization, mesh, device, pad_id)
