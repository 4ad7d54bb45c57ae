"""The final output of a model-producing stage: an HF folder that appears complete or not at all.

Every rank takes part in gathering the (sharded) weights; rank 0 writes into a temporary sibling
of `out` and renames it (`atomic_dir`): `config.json` + `generation_config.json`, tokenizer files,
`metrics.jsonl`, `posttrain.json`, and the weights, by the stage's `save` for LoRA/QLoRA:

- `both` (the default): the merged weights (safetensors) plus the adapters in PEFT format under `adapter/`;
- `merged`: the merged weights alone;
- `adapter`: the adapters alone, in PEFT format in the folder itself (`adapter_config.json` naming the base,
  `adapter_model.safetensors`); readers of the folder (`model_files.model_tensors`) merge them into the base.

Full fine-tuning writes the weights (`save` says nothing there; `adapter` is refused by `rules.adapter_save_problem`).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.model_files import save_hf_model
from posttrain.model_files.hf import checkpoint_state, write_hf_config
from posttrain.models.lora import merged_state_dict, save_peft_adapter
from posttrain.parallel import barrier, gather_full_state_dict
from posttrain.rewards.specs import declares_classifier
from posttrain.tokenizer import Tokenizer
from posttrain.utils.io import atomic_dir
from posttrain.utils.provenance import write_provenance

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def save_final_model(
    out: str | Path,
    model: nn.Module,
    *,
    hf_config: dict[str, Any],
    tokenizer: Tokenizer,
    cfg: Mapping[str, Any],
    started: float,
    summary: dict[str, Any],
    metrics_path: Path | None,
    is_main: bool,
    base_model: str | None = None,
    save: str = "both",
) -> None:
    """Gather, merge adapters, and write the stage output `out` atomically (collective).

    `cfg` is the resolved config (its `stage`, `key`, `model.dtype` are used); `summary` goes
    into `posttrain.json`; `base_model` names the adapters' base in their `adapter_config.json`;
    `save` (merged | adapter | both) what a LoRA/QLoRA model writes. A `hf_config` of a sequence
    classifier (the reward model) gives a PEFT adapter of task type SEQ_CLS.
    """
    full = gather_full_state_dict(model)  # under the model's module names, the adapters' (PEFT's) too
    if is_main:
        lora = getattr(model, "lora_config", None) is not None
        dtype = DTYPES[cfg["model"]["dtype"]]
        task_type = "SEQ_CLS" if declares_classifier(hf_config) else "CAUSAL_LM"
        with atomic_dir(out) as tmp:
            if lora and save == "adapter":
                write_hf_config(hf_config, tmp, dtype=dtype)
                save_peft_adapter(model, tmp, base_model, full, task_type)
            else:
                weights = merged_state_dict(model, full) if lora else full
                save_hf_model(checkpoint_state(model, weights), hf_config, tmp, dtype=dtype)
            tokenizer.save(tmp)
            if lora and save == "both":
                save_peft_adapter(model, tmp / "adapter", base_model, full, task_type)
            if metrics_path is not None and metrics_path.exists():
                shutil.copyfile(metrics_path, tmp / "metrics.jsonl")
                logs = metrics_path.parent / "logs"
                if logs.is_dir():
                    shutil.copytree(logs, tmp / "logs")
            write_provenance(tmp, cfg, cfg["stage"], started, summary)
    barrier()
