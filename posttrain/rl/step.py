"""One optimizer step of the RL stage: advantages, then `grpo.inner_epochs` clipped policy-gradient passes.

    step = GRPOStep(grpo, model, head, optimization, baseline, reference, pad_id, mesh, device)
    record = step(rollouts, step_number)      # the step's metrics, every rank's rows counted

The baseline is the strategy that turns rewards into advantages: `GroupBaseline` (GRPO, Dr. GRPO,
RLOO, REINFORCE++: relative to the prompt's group) or `CriticBaseline` (PPO: a learned value per
token, GAE, and the critic's own step beside the policy's). The step itself reads as the
algorithm: the loss divides by the whole step's token (or completion) count; the PPO ratio is
taken against the trainer's own log-probs at the step's starting weights, which the first pass
computes anyway (exactly 1 there); the generator's log-probs enter only the truncated importance
weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from posttrain.losses.grpo import grpo_loss
from posttrain.losses.head import OutputHead
from posttrain.losses.ppo import gae, whiten
from posttrain.models import Transformer
from posttrain.models.lora import disable_adapters
from posttrain.parallel import mesh_size
from posttrain.rl.batch import MicroBatch, advantages, micro_batches
from posttrain.rl.collection import StepBatch
from posttrain.rl.critic import Critic
from posttrain.rl.rollout import RolloutGroup
from posttrain.training.optimization import Optimization
from posttrain.training.stats import data_parallel_sum, local_value, max_over_ranks


class GroupBaseline:
    """Advantages relative to each prompt's group of completions (`grpo.advantage`: grpo, dr_grpo, rloo, reinforce_pp)."""

    def __init__(self, grpo: Mapping[str, Any], mesh: DeviceMesh | None, device: torch.device):
        self.grpo, self.mesh, self.device = grpo, mesh, device

    def advantages(self, groups: Sequence[RolloutGroup]) -> Tensor:
        return advantages(groups, self.grpo["std_normalize"], self.grpo["advantage"],
                          lambda values: data_parallel_sum(values, self.mesh, self.device))

    def prepare(self, batches: list[MicroBatch]) -> None:
        """Nothing to add to the micro-batches: a completion's advantage is its every token's."""

    def backward(self, i: int, batch: MicroBatch, step_tokens: float) -> None:
        """No model of its own to train."""

    def step(self) -> None:
        """No optimizer of its own."""

    def metrics(self, passes: int, step_tokens: float) -> dict[str, float]:
        return {}


class CriticBaseline:
    """PPO (`grpo.advantage: gae`): the critic values every completion token, GAE (`grpo.gamma`, `grpo.gae_lambda`)
    spreads the completion's reward over its tokens, whitened over the step (`grpo.std_normalize`), and each
    pass also takes one step on the clipped value loss."""

    def __init__(self, critic: Critic, grpo: Mapping[str, Any], mesh: DeviceMesh | None, device: torch.device):
        self.critic, self.grpo, self.mesh, self.device = critic, grpo, mesh, device
        self.targets: list[tuple[Tensor, Tensor]] = []
        self.sums = dict.fromkeys(("value_loss", "value_mean", "value_clip_frac"), 0.0)
        self.grad_norm = 0.0

    def advantages(self, groups: Sequence[RolloutGroup]) -> Tensor:
        """Each completion's reward, spread over its tokens by `prepare`."""
        return torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)

    def prepare(self, batches: list[MicroBatch]) -> None:
        """Per-token advantages from the critic's values by GAE, put into `batches` in place of the rewards; keeps each
        batch's (values, returns), the value loss's targets."""
        self.sums = dict.fromkeys(self.sums, 0.0)
        device, targets, token_advantages = self.device, [], []
        masks = [batch.mask.to(device) for batch in batches]
        for batch, mask in zip(batches, masks):
            values = self.critic.values(batch.input_ids.to(device))
            adv, returns = gae(batch.advantages.to(device), values, mask, self.grpo["gamma"], self.grpo["gae_lambda"])
            targets.append((values * mask, returns))
            token_advantages.append(adv)
        if self.grpo["std_normalize"]:
            flat = torch.cat([adv[mask] for adv, mask in zip(token_advantages, masks)]).double()
            total, total_sq, count = data_parallel_sum([flat.sum(), flat.square().sum(), flat.numel()], self.mesh, device)
            token_advantages = [whiten(adv, mask, total, total_sq, count) for adv, mask in zip(token_advantages, masks)]
        for i, adv in enumerate(token_advantages):
            batches[i] = dataclasses.replace(batches[i], advantages=adv.cpu())
        self.targets = targets

    def backward(self, i: int, batch: MicroBatch, step_tokens: float) -> None:
        value = self.critic.backward(batch.input_ids, *self.targets[i], batch.mask, denominator=step_tokens)
        tokens = float(batch.mask.sum())
        self.sums["value_loss"] += value["value_loss"]
        for name in ("value_mean", "value_clip_frac"):
            self.sums[name] += value[name] * tokens

    def step(self) -> None:
        self.grad_norm = self.critic.step()

    def metrics(self, passes: int, step_tokens: float) -> dict[str, float]:
        value_loss, value_mean, value_clip = data_parallel_sum(list(self.sums.values()), self.mesh, self.device)
        return {"value_loss": value_loss / passes, "critic_grad_norm": self.grad_norm,
                "value_mean": value_mean / max(step_tokens * passes, 1),
                "value_clip_frac": value_clip / max(step_tokens * passes, 1)}


Baseline = GroupBaseline | CriticBaseline


class StepMetrics:
    """The policy passes' metrics: this rank's sums over its micro-batches, reduced over the ranks once per step."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(("loss", "entropy", "clip_frac", "kl", "generator_kl", "tis_weight", "gap"), 0.0)
        self.gap_max = 0.0  # largest |trainer - generator| token log-prob at the step's starting weights

    def add(self, loss: Tensor, loss_metrics: Mapping[str, Tensor], tokens: float) -> None:
        """A pass's micro-batch: its loss, and its token-weighted clip fraction, importance weight and KL."""
        self.sums["loss"] += float(local_value(loss.detach()))
        self.sums["clip_frac"] += float(loss_metrics["clip_frac"]) * tokens
        self.sums["tis_weight"] += float(loss_metrics["tis/weight_mean"]) * tokens
        if "kl" in loss_metrics:
            self.sums["kl"] += float(loss_metrics["kl"]) * tokens

    def add_first_pass(self, batch: MicroBatch, logp: Tensor, entropy: Tensor) -> None:
        """What only the step's starting weights measure: entropy, and the trainer/generator log-prob gap."""
        self.sums["entropy"] += float((entropy.detach() * batch.mask).sum())
        log_gap = (batch.generator_logprobs - logp.detach()) * batch.mask
        self.sums["generator_kl"] += float((log_gap.exp() - log_gap - 1).sum())
        self.sums["gap"] += float(log_gap.abs().sum())
        self.gap_max = max(self.gap_max, float(log_gap.abs().max()))

    def record(self, passes: int, step_tokens: float, kl: bool, mesh: DeviceMesh | None,
               device: torch.device) -> dict[str, float]:
        loss, entropy, clip, kl_sum, gen_kl, tis, gap = data_parallel_sum(list(self.sums.values()), mesh, device)
        record = {
            "loss": loss / passes,
            "entropy": entropy / max(step_tokens, 1),
            "clip_frac": clip / max(step_tokens * passes, 1),
            "generator_kl": gen_kl / max(step_tokens, 1),
            "logprob_gap_max": max_over_ranks(self.gap_max, device),
            "logprob_gap_mean": gap / max(step_tokens, 1),
            "tis_weight_mean": tis / max(step_tokens * passes, 1),
        }
        if kl:
            record["kl"] = kl_sum / max(step_tokens * passes, 1)
        return record


class GRPOStep:
    """Advantages, then `grpo.inner_epochs` passes over a step's rollouts with one optimizer step each."""

    def __init__(self, grpo: Mapping[str, Any], model: Transformer, head: OutputHead, optimization: Optimization,
                 baseline: Baseline, reference: Transformer | None, ref_head: OutputHead | None, pad_id: int,
                 mesh: DeviceMesh | None, device: torch.device):
        self.grpo, self.model, self.head, self.optimization, self.baseline = grpo, model, head, optimization, baseline
        self.reference, self.ref_head, self.pad_id, self.mesh, self.device = reference, ref_head, pad_id, mesh, device

    def __call__(self, rollouts: StepBatch, step: int) -> dict[str, Any]:
        grpo, mesh, device, passes = self.grpo, self.mesh, self.device, self.grpo["inner_epochs"]
        batches = micro_batches(rollouts.groups, self.baseline.advantages(rollouts.groups), grpo["micro_batch_size"],
                                self.pad_id, length_multiple=mesh_size(mesh, "tp"))
        self.baseline.prepare(batches)
        step_tokens, step_rows = data_parallel_sum(
            [sum(int(b.mask.sum()) for b in batches), sum(len(b.advantages) for b in batches)], mesh, device)
        # GSPO's loss is a mean over sequences; token-level normalization is a token ratio's
        denominator = step_tokens if grpo["token_level"] and grpo["ratio"] == "token" else step_rows
        old: list[Tensor] = []
        ref: list[Tensor | None] = []
        metrics = StepMetrics()
        outcome: dict[str, Any] = {}
        for epoch in range(passes):
            for i, batch in enumerate(batches):
                batch = batch.to(device)
                with self.head.context():
                    logp, entropy = self.head.token_logprobs_and_entropy(
                        self.model(batch.input_ids), batch.targets, batch.mask, grpo["temperature"])
                    if epoch == 0:
                        old.append(logp.detach())
                        ref.append(self.reference_logprobs(batch))
                    loss, loss_metrics = grpo_loss(
                        logp, old[i], batch.advantages, batch.mask, clip_eps=grpo["clip_eps"],
                        token_level=grpo["token_level"], denominator=denominator, ref_logprobs=ref[i],
                        kl_coef=grpo["kl_coef"], generator_logprobs=batch.generator_logprobs,
                        tis_cap=grpo["tis_cap"], clip_eps_high=grpo["clip_eps_high"], ratio_level=grpo["ratio"],
                    )
                    self.optimization.backward(loss)
                self.baseline.backward(i, batch, step_tokens)
                metrics.add(loss, loss_metrics, float(batch.mask.sum()))
                if epoch == 0:
                    metrics.add_first_pass(batch, logp, entropy)
            self.baseline.step()
            (step_loss,) = data_parallel_sum([metrics.sums["loss"]], mesh, device)
            # lr, the last pass's grad_norm, and skipped when any pass was
            outcome = {**self.optimization.step(step, step_loss, advance_schedule=epoch == passes - 1),
                       **({"skipped": 1} if "skipped" in outcome else {})}
        record = metrics.record(passes, step_tokens, self.reference is not None, mesh, device)
        return {"loss": record.pop("loss"), **rollouts.stats, **record, **outcome, "samples": int(step_rows),
                **self.baseline.metrics(passes, step_tokens)}

    @torch.no_grad()
    def reference_logprobs(self, batch: MicroBatch) -> Tensor | None:
        """The frozen starting model's token log-probs (for the KL term), or None without one; `reference` is a
        frozen copy, or the policy itself, whose LoRA adapters are disabled for this forward."""
        if self.reference is None:
            return None
        with disable_adapters(self.reference):
            return self.ref_head.token_logprobs_and_entropy(self.reference(batch.input_ids), batch.targets, batch.mask,
                                                           self.grpo["temperature"])[0]
