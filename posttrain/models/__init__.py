"""Decoder-only transformer (the families of docs/models.md) and named presets."""

from posttrain.models.args import SUPPORTED_MODEL_TYPES, ModelArgs, ModelConfigError
from posttrain.models.attention import document_mask
from posttrain.models.presets import PRESETS, is_preset, preset_config
from posttrain.models.transformer import KVCache, Transformer, document_positions

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ModelArgs",
    "ModelConfigError",
    "PRESETS",
    "is_preset",
    "preset_config",
    "KVCache",
    "Transformer",
    "document_mask",
    "document_positions",
]
