"""SFT's step: the summed cross-entropy of the step's micro-batches over its trained tokens."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from posttrain.losses.head import OutputHead, summed_lm_loss
from posttrain.models import Transformer
from posttrain.training.optimization import Optimization
from posttrain.training.token_step import TokenLossStep


def sft_step(model: Transformer, head: OutputHead, optimization: Optimization, mesh: DeviceMesh | None,
             device: torch.device, pad_id: int) -> TokenLossStep:
    """`step(batches)` -> the step's `loss` per trained token, `loss_tokens`, `useful_tokens`."""

    def loss_of(batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        return summed_lm_loss(model, head, batch), {}

    return TokenLossStep(loss_of, optimization, mesh, device, pad_id, context=head.context)
