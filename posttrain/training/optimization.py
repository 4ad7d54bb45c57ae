"""One optimizer step's rules, in one place: gradient scale, clipping, the non-finite guard, the schedule.

Every training stage backpropagates through `backward` and steps through `step`, so what
optimizer-in-backward changes (no clipping, no skipped batch: the parameters are already
updated when the loss is known) and how FSDP2's averaging over data-parallel replicas is undone
are decided here alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from posttrain.models.args import ModelArgs
from posttrain.optim import OptimizerInBackward, clip_grad_norm_
from posttrain.parallel import mesh_size
from posttrain.rules import optimizer_in_backward_problems
from posttrain.training.faults import NonFiniteLossGuard, SettingError
from posttrain.training.setup import build_optimizer_and_scheduler, max_grad_norm


class Optimization:
    """The optimizer, warmup-cosine schedule, clipping and guard of one model, per the stage's section.

    `last_checkpoint` names the newest resume state for the guard's message when it stops the stage.
    """

    def __init__(
        self,
        model: nn.Module,
        section: Mapping[str, Any],
        memory: Mapping[str, Any],
        mesh: DeviceMesh | None,
        config_key: str,
        last_checkpoint: Callable[[], Path | None] = lambda: None,
    ):
        self.model = model
        self.optimizer, self.scheduler = build_optimizer_and_scheduler(model, section, memory)
        self.in_backward = isinstance(self.optimizer, OptimizerInBackward)
        self.clip = max_grad_norm(section)
        self.guard = NonFiniteLossGuard(int(section["skip_nonfinite"]), f"{config_key}.skip_nonfinite",
                                        skip_possible=not self.in_backward)
        self.replicas = mesh_size(mesh, "dp_replicate") * mesh_size(mesh, "dp_shard")
        self.last_checkpoint = last_checkpoint
        self.config_key = config_key
        # MoE: each backward adds its forward's load-balancing loss, averaged over the step's forwards
        # (grad_accum per rank; GRPO trains one micro-batch a step).
        args = getattr(model, "args", None)  # a Transformer's; any other module routes nothing
        self.aux_coef = float(args.router_aux_loss_coef) if isinstance(args, ModelArgs) else 0.0
        self.forwards = int(section["grad_accum"]) if "grad_accum" in section else 1

    def backward(self, loss: torch.Tensor, per: float = 1) -> None:
        """Backpropagate `loss / per`, where `per` is what the step's loss is normalized by, all ranks together.

        A loss summed over tokens passes the step's token count; a loss already normalized passes 1.
        FSDP2 averages gradients over the data-parallel replicas, so the loss is scaled up by their
        number: the gradient is then that of the whole step's normalized loss. A mixture-of-experts
        model adds `router_aux_loss_coef` x the load-balancing loss of the forward being propagated.
        """
        total = loss * (self.replicas / max(per, 1))
        aux = self.model.aux_loss if self.aux_coef else None
        if aux is not None:  # a mean already: FSDP's averaging over replicas is what it needs
            total = total + aux * (self.aux_coef / self.forwards)
        total.backward()

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def step(self, step: int, loss: float, advance_schedule: bool = True) -> dict[str, float]:
        """Clip, step (unless the guard skips this batch), zero the gradients; returns lr, grad_norm, skipped.

        `advance_schedule=False` keeps the learning rate for another optimizer step in the same
        training step (GRPO's inner epochs).
        """
        record: dict[str, float] = {"lr": self.lr}
        grad_norm = None if self.in_backward else clip_grad_norm_(self.model.parameters(), self.clip)
        if self.guard.should_skip(step, loss, grad_norm, self.last_checkpoint()):
            record["skipped"] = 1
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if advance_schedule:
            self.scheduler.step()
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        return record

    def one_micro_batch(self, rows: int, micro_batch_size: int) -> None:
        """Refuse a step of `rows` rows per process in several micro-batches under optimizer-in-backward."""
        problems = optimizer_in_backward_problems(rows=rows, micro_batch_size=micro_batch_size) if self.in_backward else []
        if problems:
            setting, why = problems[0]
            raise SettingError(f"{self.config_key}.{setting}: {why}")
