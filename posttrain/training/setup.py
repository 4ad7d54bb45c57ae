"""Build what every training stage starts from: the model on its mesh, the optimizer, the schedule.

A model source is a preset name (random init from `posttrain.models.presets`, sized to the data
directory's tokenizer), a local HF folder or a hub id. Two build paths give the same weights:

- one process, or QLoRA (NF4 quantization needs real weights before sharding): build the full
  model, add adapters, `parallelize`;
- several processes otherwise: build on the meta device, add adapters, `parallelize`, allocate
  the shards, and load the full weights that rank 0 alone reads (or random-inits) by broadcast.

Random init always happens on one full CPU model seeded with the run's seed, so 1 and N
processes start from identical weights.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from posttrain.model_files import load_hf_model, read_hf_config, resolve_model_source
from posttrain.models import ModelConfigError, Transformer, is_preset, preset_config
from posttrain.models.args import model_backend
from posttrain.models.hf_backend import HFCausalLM, build_transformers_model
from posttrain.models.lora import ALL_LINEAR, apply_lora
from posttrain.optim import build_lr_scheduler, build_optimizer
from posttrain.parallel import DistInfo, load_full_state_dict, materialize, parallelize
from posttrain.tokenizer import Tokenizer

METHODS = ("full", "lora", "qlora")


def seed_everything(seed: int) -> None:
    """Seed python and torch (all devices): data order has its own seeded generator."""
    random.seed(seed)
    torch.manual_seed(seed)


def model_config(source: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """The HF config of `source`: a preset sized to the tokenizer, or the folder's config.json.

    Refuses a tokenizer with more ids than the model's embedding has rows.
    """
    if is_preset(source):
        eos = tokenizer.eos_ids
        return preset_config(
            source,
            vocab_size=tokenizer.vocab_size,
            bos_token_id=tokenizer.bos_id,
            eos_token_id=eos[0] if len(eos) == 1 else eos,
            pad_token_id=tokenizer.pad_id,
        )
    folder = resolve_model_source(source)
    config = read_hf_config(folder)
    if tokenizer.vocab_size > int(config.get("vocab_size", 0)):
        raise ModelConfigError(
            f"{tokenizer.folder}: the tokenizer has {tokenizer.vocab_size} ids but {folder / 'config.json'} "
            f"has vocab_size {config.get('vocab_size')}; use the model's own tokenizer (model.tokenizer: null)"
        )
    return config


def initial_state(source: str | None, hf_config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Full starting weights on CPU: seeded random init of `hf_config` for a preset (or None), else the folder's."""
    return initial_model(source, hf_config, seed).state_dict()


def backend_of(source: str | None, hf_config: dict[str, Any], backend: str) -> str:
    """`model.backend` decided for `hf_config` ("native" or "transformers"), refusals naming the folder's config.json."""
    where = "config.json" if source is None or is_preset(source) else str(resolve_model_source(source) / "config.json")
    return model_backend(hf_config, backend, where)


def initial_model(source: str | None, hf_config: dict[str, Any], seed: int,
                  backend: str = "native") -> Transformer | HFCausalLM:
    """The full model every stage starting from `source` begins with, on CPU (also what `eval.base` evaluates);
    `backend` is `model.backend`."""
    if source is None or is_preset(source):
        torch.manual_seed(seed)
        if backend_of(source, hf_config, backend) == "transformers":
            return build_transformers_model(hf_config)
        return Transformer(hf_config)
    return load_hf_model(source, backend=backend)


def build_model(
    source: str | None,
    hf_config: dict[str, Any],
    info: DistInfo,
    mesh: DeviceMesh | None,
    cfg: Mapping[str, Any],
    method: str = "full",
    lora_cfg: Mapping[str, Any] | None = None,
) -> Transformer | HFCausalLM:
    """The model from `source` with `method`'s adapters, parallelized per `cfg['memory']`/`cfg['parallel']`.

    `source` None or a preset: random init of `hf_config` (seeded by `cfg['seed']`); else a folder
    or hub id whose weights fill `hf_config`'s architecture (`model_config(source, ...)`).
    `method`: full (every weight trains), lora, or qlora (NF4 frozen base); `lora_cfg` is the
    stage's `lora` section; `cfg['model']['backend']` picks the model code. Every rank calls this.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    seed = int(cfg["seed"])
    backend = cfg["model"]["backend"]
    on_transformers = backend_of(source, hf_config, backend) == "transformers"
    if mesh is None or method == "qlora" or on_transformers:
        # transformers' models are built whole on every rank (no meta-device build), then sharded.
        model = initial_model(source, hf_config, seed, backend).to(info.device)
        add_adapters(model, method, lora_cfg)
        return parallelize(model, mesh, cfg["memory"], cfg["parallel"])
    with torch.device("meta"):
        model = Transformer(hf_config)
    add_adapters(model, method, lora_cfg)
    parallelize(model, mesh, cfg["memory"], cfg["parallel"])
    materialize(model, info.device, init=False)
    state = initial_state(source, hf_config, seed) if info.is_main else {}
    load_full_state_dict(model, state, broadcast_from_rank0=True)
    return model


def add_adapters(model: Transformer | HFCausalLM, method: str, lora_cfg: Mapping[str, Any] | None,
                 modules_to_save: tuple[str, ...] = ()) -> None:
    """`method`'s adapters (none for full) from a stage's `lora` section; `modules_to_save` stay trainable and
    are saved with the adapter (the reward model's score head)."""
    if method == "full":
        return
    if not lora_cfg:
        raise ValueError(f"method {method!r} needs the stage's `lora` section (rank, alpha, dropout, targets)")
    apply_lora(
        model,
        rank=int(lora_cfg["rank"]),
        alpha=float(lora_cfg["alpha"]),
        dropout=float(lora_cfg.get("dropout", 0.0)),
        targets=lora_cfg["targets"] if lora_cfg["targets"] == ALL_LINEAR else tuple(lora_cfg["targets"]),
        quantize_base=method == "qlora",
        modules_to_save=modules_to_save,
    )


def build_optimizer_and_scheduler(
    model: nn.Module, stage_cfg: Mapping[str, Any], memory_cfg: Mapping[str, Any]
) -> tuple[Optimizer, LRScheduler]:
    """AdamW (per `memory`) over the trainable parameters and the learning-rate schedule of the stage.

    Reads `lr`, `weight_decay`, `grad_accum`, `max_grad_norm` (0 or null: no clipping),
    `warmup_steps`, `steps`, `min_lr_ratio`, `schedule`, `decay_ratio` from the stage's section.
    """
    optimizer = build_optimizer(
        model,
        lr=float(stage_cfg["lr"]),
        weight_decay=float(stage_cfg.get("weight_decay", 0.0)),
        memory_cfg=memory_cfg,
        grad_accum=int(stage_cfg.get("grad_accum", 1)),
        max_grad_norm=max_grad_norm(stage_cfg),
    )
    scheduler = build_lr_scheduler(
        optimizer,
        warmup_steps=int(stage_cfg.get("warmup_steps", 0)),
        total_steps=int(stage_cfg["steps"]),
        min_lr_ratio=float(stage_cfg.get("min_lr_ratio", 1.0)),
        schedule=stage_cfg.get("schedule", "cosine"),
        decay_ratio=float(stage_cfg.get("decay_ratio", 0.1)),
    )
    return optimizer, scheduler


def max_grad_norm(stage_cfg: Mapping[str, Any]) -> float | None:
    """The stage's clipping threshold; 0 or null turn clipping off."""
    value = stage_cfg.get("max_grad_norm")
    return float(value) if value else None
