"""Checks shared by the LoRA tests: what a LoRA stage wrote is its start plus the trained adapters, nothing else."""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.model_files import read_safetensors
from posttrain.models.lora import PEFT_PREFIX, fold_adapter
from sft_testing import weights


def assert_only_adapters_trained(start: dict[str, torch.Tensor], out: Path, adapter: Path, scale: float,
                                 head: str | None = None) -> int:
    """Every merged weight of `out` is its start's, bitwise, or (an adapted module) the start's with the trained
    adapter folded in, bitwise; each adapter trained (B non-zero). `head`: a module trained in full. Returns how
    many modules were adapted."""
    merged, tensors = weights(out), read_safetensors([adapter / "adapter_model.safetensors"])
    adapted = 0
    for name, weight in merged.items():
        if head is not None and name.startswith(f"{head}."):
            assert torch.equal(weight, tensors[PEFT_PREFIX + name]) and not torch.equal(weight, start[name])
            continue
        module = name.removesuffix(".weight")
        a, b = tensors.get(f"{PEFT_PREFIX}{module}.lora_A.weight"), tensors.get(f"{PEFT_PREFIX}{module}.lora_B.weight")
        if a is None:
            assert torch.equal(weight, start[name]), f"{name} has no adapter but changed"
            continue
        adapted += 1
        assert b.abs().max() > 0, f"{module}.lora_B never trained"
        assert torch.equal(weight, fold_adapter(start[name], a, b, scale)), f"{name} is not its base plus the adapter"
    return adapted
