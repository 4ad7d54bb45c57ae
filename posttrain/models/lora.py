"""LoRA and QLoRA adapters on the decoder's linear layers, merge, and PEFT-format export.

`apply_lora` swaps each targeted `nn.Linear` for a `LoRALinear` in place. The frozen base weight
keeps its HF name (`...q_proj.weight`) and the adapters sit beside it as `...q_proj.lora_A.weight`
and `...q_proj.lora_B.weight` -- PEFT's own names -- so a state dict is the HF checkpoint plus
adapter tensors, merging is a pure function of it, and PEFT export only adds a prefix.
QLoRA stores the frozen base weights in NF4 (torchao) and dequantizes per matmul.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

LORA_KEYS = (".lora_A.weight", ".lora_B.weight")
ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer but the output head
PEFT_PREFIX = "base_model.model."  # PEFT's names for the wrapped model's tensors
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


@dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    quantize_base: bool
    modules_to_save: tuple[str, ...] = ()


def is_nf4(t: torch.Tensor) -> bool:
    """Whether `t` (or the local shard of a DTensor) is a torchao NF4 tensor.

    Without torchao imported no tensor can be NF4, so plain LoRA never pays torchao's import.
    """
    nf4 = sys.modules.get("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    if nf4 is None:
        return False
    return isinstance(t._local_tensor if isinstance(t, DTensor) else t, nf4.NF4Tensor)


def dequantize(weight: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the weight's original dtype (NF4 weights are dequantized)."""
    return weight.get_original_weight() if is_nf4(weight) else weight


class LoRALinear(nn.Module):
    """`y = x W^T + b + scale * B(A(dropout(x)))` with W (optionally NF4) and b frozen.

    A is Kaiming-uniform and B zero, so a fresh adapter leaves the model's function unchanged.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, quantize_base: bool):
        super().__init__()
        if rank < 1:
            raise ValueError(f"lora.rank must be >= 1, got {rank}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.scale = alpha / rank
        self.disabled = False
        weight = base.weight.detach()
        if quantize_base:
            if weight.is_meta:
                raise ValueError("QLoRA quantizes real weights: load the checkpoint before apply_lora(quantize_base=True)")
            from torchao.quantization import to_nf4

            weight = to_nf4(weight)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if base.bias is None else nn.Parameter(base.bias.detach(), requires_grad=False)
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if not base.weight.is_meta:
            self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_nf4(self.weight):
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

            out = linear_nf4(x, self.weight)
            if self.bias is not None:
                out = out + self.bias
        else:
            out = F.linear(x, self.weight, self.bias)
        if self.disabled:
            return out
        return out + self.lora_B(self.lora_A(self.dropout(x))) * self.scale

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.lora_A.out_features}, scale={self.scale}"


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    targets: Sequence[str] | str = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    quantize_base: bool = False,
    modules_to_save: Sequence[str] = (),
) -> nn.Module:
    """Freeze every parameter and wrap the `nn.Linear`s whose last name component is in `targets`.

    `targets="all-linear"` (PEFT's meaning) wraps every `nn.Linear` but the output head: the way to
    adapt a family whose projections have other names (GPT-NeoX's `query_key_value`, ...) on the
    transformers backend. `quantize_base=True` is QLoRA (NF4 base weights): call it on a model
    holding its real weights (load the checkpoint first), before `parallelize`. `modules_to_save`:
    top-level modules that stay fully trainable and are saved with the adapter (PEFT's
    `modules_to_save`: the reward model's new `score` head, which no base holds); trained in full,
    they take no adapter, all-linear or not.
    """
    head = getattr(model, "lm_head", None)
    modules_to_save = tuple(modules_to_save)
    linear = {name: module for name, module in model.named_modules()
              if isinstance(module, nn.Linear) and name.split(".", 1)[0] not in modules_to_save}
    if targets == ALL_LINEAR:
        targets = tuple(dict.fromkeys(n.rsplit(".", 1)[-1] for n, m in linear.items() if m is not head))
    targets = fused_targets(model, tuple(targets))
    for p in model.parameters():
        p.requires_grad_(False)
    for name in modules_to_save:
        model.get_submodule(name).requires_grad_(True)
    matched: set[str] = set()
    for name, module in linear.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in targets:
            continue
        if module is head and getattr(model, "tied_head", False):
            raise ValueError(f"lora.targets: {leaf} is tied to the embeddings and cannot take an adapter")
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(parent, leaf, LoRALinear(module, rank, alpha, dropout, quantize_base))
        matched.add(leaf)
    missing = [t for t in targets if t not in matched]
    if missing:
        names = ", ".join(dict.fromkeys(n.rsplit(".", 1)[-1] for n in linear))
        raise ValueError(f"lora.targets: {missing} match no nn.Linear in the model (its linear layers: {names}; "
                         f"or lora.targets: {ALL_LINEAR})")
    model.lora_config = LoRAConfig(rank, float(alpha), float(dropout), targets, quantize_base, modules_to_save)
    return model


FUSED_GROUPS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


def fused_targets(model: nn.Module, targets: tuple[str, ...]) -> tuple[str, ...]:
    """Targets in the model's own module names: Phi-3 fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`.

    The per-projection names (the default targets) then mean the fused module holding them all, one
    adapter over the fused weight as PEFT trains it; a part of a fused group alone has no module.
    """
    args = getattr(model, "args", None)
    if not getattr(args, "fused_projections", False):
        return targets
    out = list(targets)
    for fused, parts in FUSED_GROUPS:
        present = [t for t in parts if t in out]
        if not present:
            continue
        if len(present) < len(parts):
            raise ValueError(f"lora.targets: {', '.join(present)} alone cannot take an adapter in {args.model_type}, "
                             f"whose {fused} fuses {', '.join(parts)}: target all of them, or {fused}")
        out[out.index(present[0])] = fused
        out = [t for t in out if t not in parts]
    return tuple(dict.fromkeys(out))


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(HF module name, module) of every adapter, wrapper prefixes (checkpointing, compile) removed."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            for prefix in _WRAPPER_PREFIXES:
                name = name.replace(prefix, "")
            yield name, module


@contextlib.contextmanager
def disable_adapters(model: nn.Module) -> Iterator[None]:
    """Run the frozen base model (e.g. the DPO reference) without copying it."""
    modules = [m for _, m in lora_modules(model)]
    previous = [m.disabled for m in modules]
    for m in modules:
        m.disabled = True
    try:
        yield
    finally:
        for m, was in zip(modules, previous):
            m.disabled = was


def merged_state_dict(
    model: nn.Module, full_state_dict: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Plain HF state dict with `W + scale * B @ A` folded in (NF4 dequantized), adapters dropped.

    `full_state_dict` is the gathered state dict of a sharded model (rank 0 of
    `posttrain.parallel.parallelize.gather_full_state_dict`); by default the model's own (it
    must then be unsharded). An empty dict (non-zero ranks) gives an empty dict.
    """
    state = model.state_dict() if full_state_dict is None else full_state_dict
    if not state:
        return {}
    merged = {k: dequantize(v).detach() for k, v in state.items() if not k.endswith(LORA_KEYS)}
    for name, module in lora_modules(model):
        merged[f"{name}.weight"] = fold_adapter(merged[f"{name}.weight"], state[f"{name}.lora_A.weight"],
                                                state[f"{name}.lora_B.weight"], module.scale)
    return merged


def fold_adapter(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """`W + scale * B @ A`, computed in float32 and returned in W's dtype: the one merge of a trained model and of a
    saved adapter folder, so both give the same bits."""
    delta = (b.to(torch.float32) @ a.to(torch.float32)) * scale
    return (weight.to(torch.float32) + delta.to(weight.device)).to(weight.dtype)


def merge_peft_adapter(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor],
                       adapter_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A base model's tensors with a PEFT LoRA adapter (`save_peft_adapter`'s files, read) folded in.

    The adapter's `modules_to_save` tensors (a reward model's `score.weight`) replace or add to the base's.
    """
    if adapter_config.get("peft_type") != "LORA" or adapter_config.get("use_dora") or adapter_config.get("use_rslora"):
        raise ValueError("only plain LoRA adapters (peft_type LORA, no DoRA, no rsLoRA) can be merged")
    scale = float(adapter_config["lora_alpha"]) / int(adapter_config["r"])
    merged = dict(base)
    names = {k.removeprefix(PEFT_PREFIX) for k in adapter}
    for key in sorted(names):
        if key.endswith(LORA_KEYS[0]):
            module = key.removesuffix(LORA_KEYS[0])
            merged[f"{module}.weight"] = fold_adapter(base[f"{module}.weight"], adapter[PEFT_PREFIX + key],
                                                      adapter[f"{PEFT_PREFIX}{module}{LORA_KEYS[1]}"], scale)
        elif not key.endswith(LORA_KEYS[1]):
            merged[key] = adapter[PEFT_PREFIX + key]
    return merged


def adapter_state_dict(
    model: nn.Module, full_state_dict: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The adapter tensors under PEFT's names: `base_model.model.<module>.lora_A.weight`, and the whole
    `modules_to_save` (`base_model.model.score.weight`)."""
    state = model.state_dict() if full_state_dict is None else full_state_dict
    adapters = {f"{name}{suffix}" for name, _ in lora_modules(model) for suffix in LORA_KEYS}
    saved = model.lora_config.modules_to_save
    adapters |= {k for k in state if k.split(".", 1)[0] in saved}
    return {PEFT_PREFIX + k: state[k].detach().cpu().contiguous() for k in sorted(adapters)}


def save_peft_adapter(
    model: nn.Module,
    out_dir: str | os.PathLike,
    base_model_name_or_path: str | None = None,
    full_state_dict: dict[str, torch.Tensor] | None = None,
    task_type: str = "CAUSAL_LM",
) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors`, loadable by `peft.PeftModel`.

    PEFT is not needed here: the format is two files. Each is written to a temporary name and
    renamed, so a reader never sees half a file. `task_type`: PEFT's (CAUSAL_LM, or SEQ_CLS for a reward model).
    """
    cfg: LoRAConfig | None = getattr(model, "lora_config", None)
    if cfg is None:
        raise ValueError("the model has no LoRA adapters (apply_lora was not called)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": list(cfg.modules_to_save) or None,
    }
    tmp_cfg, tmp_weights = out / "adapter_config.json.tmp", out / "adapter_model.safetensors.tmp"
    tmp_cfg.write_text(json.dumps(adapter_config, indent=2) + "\n")
    save_file(adapter_state_dict(model, full_state_dict), str(tmp_weights), metadata={"format": "pt"})
    os.replace(tmp_cfg, out / "adapter_config.json")
    os.replace(tmp_weights, out / "adapter_model.safetensors")
    return out
