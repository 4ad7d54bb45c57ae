"""AdamW in three memory flavours: plain, torchao low-bit states, and stepped inside backward.

Optimizer-in-backward steps each parameter from its post-accumulate-grad hook and frees the
gradient at once, so a full set of gradients never exists. It therefore cannot accumulate
gradients over micro-batches nor clip by a global norm (both need all gradients at once);
`build_optimizer` refuses those combinations by name.

The in-backward wrapper is a `torch.optim.Optimizer`, so an LR scheduler drives it like any
other: its `param_groups` hold the learning rates, copied into the per-parameter optimizers
just before each step. `step()` and `zero_grad()` are no-ops, so a loop reads the same for both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import AdamW, Optimizer

from posttrain.rules import optimizer_in_backward_problems

LOW_BIT_OPTIMIZERS = (None, "adamw8bit", "adamw4bit")

OptimizerFactory = Callable[[list[nn.Parameter]], Optimizer]


def _adamw_factory(lr: float, weight_decay: float, low_bit: str | None, foreach: bool | None) -> OptimizerFactory:
    if low_bit not in LOW_BIT_OPTIMIZERS:
        raise ValueError(f"memory.low_bit_optimizer must be one of {LOW_BIT_OPTIMIZERS}, got {low_bit!r}")
    if low_bit is None:
        return lambda params: AdamW(params, lr=lr, weight_decay=weight_decay, **_adamw_kernel(params, foreach))
    from torchao.optim import AdamW4bit, AdamW8bit

    cls = AdamW8bit if low_bit == "adamw8bit" else AdamW4bit
    return lambda params: cls(params, lr=lr, weight_decay=weight_decay)


def _adamw_kernel(params: list[nn.Parameter], foreach: bool | None) -> dict[str, bool]:
    """torch's fused AdamW kernel where it applies (CPU and CUDA float tensors): one pass per tensor.

    On CPU it steps 2-3x faster than the per-parameter loop torch picks by default. `foreach`
    given asks for that implementation instead (False: the per-parameter loop).
    """
    if foreach is not None:
        return {"foreach": foreach}
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return {"fused": True} if fused else {}


def _set_lr(opt: Optimizer, lr: float) -> None:
    """torchao's low-bit AdamW keeps lr as a tensor and refuses a float in its place."""
    group = opt.param_groups[0]
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


class OptimizerInBackward(Optimizer):
    """One optimizer per parameter, stepped by `register_post_accumulate_grad_hook`.

    `named_params` names the parameters (model FQNs) for `state_dict()`; every parameter's
    gradient is consumed and set to None by its hook.
    """

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], make_optimizer: OptimizerFactory):
        named = list(named_params)
        if not named:
            raise ValueError("no trainable parameters")
        self.names = [n for n, _ in named]
        self.optimizers = [make_optimizer([p]) for _, p in named]
        defaults = {k: v for k, v in self.optimizers[0].defaults.items() if k != "params"}
        super().__init__([p for _, p in named], defaults)
        # One param group here (the scheduler's view); its lr is pushed into each optimizer.
        for (_, p), opt in zip(named, self.optimizers):
            p.register_post_accumulate_grad_hook(self._hook_for(opt))

    def _hook_for(self, opt: Optimizer) -> Callable[[torch.Tensor], None]:
        group = self.param_groups[0]

        def hook(param: torch.Tensor) -> None:
            _set_lr(opt, group["lr"])
            opt.step()
            opt.zero_grad(set_to_none=True)

        return hook

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        """Nothing to do: every parameter was stepped during backward."""
        if closure is not None:
            raise ValueError("optimizer-in-backward takes no closure")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each hook frees its gradient after stepping."""

    def state_dict(self) -> dict[str, Any]:
        """Per-parameter optimizer states keyed by parameter name, plus the scheduler-facing groups."""
        return {
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "per_param": {n: opt.state_dict() for n, opt in zip(self.names, self.optimizers)},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        missing = sorted(set(self.names) - set(state_dict["per_param"]))
        if missing:
            raise KeyError(f"optimizer state lacks parameter {missing[0]!r} ({len(missing)} missing)")
        for name, opt in zip(self.names, self.optimizers):
            opt.load_state_dict(state_dict["per_param"][name])
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)

    def sync_lr(self) -> None:
        """Push the scheduler's current lr into every per-parameter optimizer (before saving them)."""
        for opt in self.optimizers:
            _set_lr(opt, self.param_groups[0]["lr"])


def check_optimizer_in_backward(grad_accum: int, max_grad_norm: float | None) -> None:
    """Refuse what optimizer-in-backward rules out (`posttrain.rules`, the dry run's rule too)."""
    problems = optimizer_in_backward_problems(grad_accum, max_grad_norm)
    if problems:
        raise ValueError("; ".join(f"{setting} {why}" for setting, why in problems))


def _named_trainable(params_or_model: nn.Module | Iterable[nn.Parameter]) -> list[tuple[str, nn.Parameter]]:
    if isinstance(params_or_model, nn.Module):
        named = params_or_model.named_parameters()
    else:
        named = ((str(i), p) for i, p in enumerate(params_or_model))
    return [(n, p) for n, p in named if p.requires_grad]


def build_optimizer(
    params_or_model: nn.Module | Iterable[nn.Parameter],
    lr: float,
    weight_decay: float,
    memory_cfg: Mapping[str, Any],
    *,
    grad_accum: int = 1,
    max_grad_norm: float | None = None,
    foreach: bool | None = None,
) -> Optimizer:
    """AdamW over the trainable parameters, as `memory.low_bit_optimizer` / `optimizer_in_backward` ask.

    Pass the model (not its parameters) when the state must be checkpointed by name. `foreach`
    applies to plain AdamW (False gives the per-parameter arithmetic that the in-backward
    optimizer uses, for bitwise comparisons). Weight decay applies to every trainable tensor.
    """
    named = _named_trainable(params_or_model)
    if not named:
        raise ValueError("no trainable parameters (all have requires_grad=False)")
    factory = _adamw_factory(lr, weight_decay, memory_cfg.get("low_bit_optimizer"), foreach)
    if memory_cfg.get("optimizer_in_backward", False):
        check_optimizer_in_backward(grad_accum, max_grad_norm)
        return OptimizerInBackward(named, factory)
    return factory([p for _, p in named])


def optimizer_state_dict(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Optimizer state keyed by parameter FQN, sharded as the model is: what DCP saves.

    Covers both the ordinary optimizer and the in-backward wrapper (its per-parameter optimizers).
    """
    optimizers = optimizer
    if isinstance(optimizer, OptimizerInBackward):
        optimizer.sync_lr()
        optimizers = optimizer.optimizers
    return get_optimizer_state_dict(model, optimizers, options=StateDictOptions(ignore_frozen_params=True))


def load_optimizer_state_dict(model: nn.Module, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Inverse of `optimizer_state_dict` (after `dcp.load` filled `state_dict` in place)."""
    optimizers = optimizer.optimizers if isinstance(optimizer, OptimizerInBackward) else optimizer
    set_optimizer_state_dict(model, optimizers, state_dict, options=StateDictOptions(ignore_frozen_params=True))
    if isinstance(optimizer, OptimizerInBackward):
        # The hooks copy the wrapper's lr into each optimizer: restore it from the loaded state.
        optimizer.param_groups[0]["lr"] = float(optimizer.optimizers[0].param_groups[0]["lr"])
