"""Hugging Face checkpoint interop (safetensors only) and model sources."""

from posttrain.model_files.hf import (
    CheckpointError,
    load_hf_model,
    load_state_into,
    model_tensors,
    read_hf_config,
    read_safetensors,
    resolve_model_source,
    save_hf_model,
    weight_files,
)

__all__ = [
    "CheckpointError",
    "load_hf_model",
    "load_state_into",
    "model_tensors",
    "read_hf_config",
    "read_safetensors",
    "resolve_model_source",
    "save_hf_model",
    "weight_files",
]
