"""The trainer's weights as generators need them: full tensors in HF names, on CPU, LoRA adapters merged."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from posttrain.models.lora import merged_state_dict
from posttrain.parallel import gather_full_state_dict
from posttrain.parallel.expert_parallel import gather_expert_states, uses_expert_parallel


def policy_weights(model: nn.Module, every_rank: bool) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights on CPU; collective under torch.distributed, every rank calls it.

    `every_rank=False` leaves them on rank 0 only (the async trainer sends them from there);
    `every_rank=True` gives each rank a copy (sync mode: every rank generates with its own copy).
    A LoRA/QLoRA policy's adapters are folded in (`merged_state_dict`): generators hold a plain model.
    """
    if not every_rank or not dist.is_initialized():
        state = gather_full_state_dict(model)
    else:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        experts = gather_expert_states(model, every_rank=True) if uses_expert_parallel(model) else {}
        state = {**{k: v.detach().cpu() for k, v in full.items()}, **experts}
    return merged_state_dict(model, state) if getattr(model, "lora_config", None) is not None else state
