"""An int8 weight-only copy of a model through torchao, in the safetensors layout transformers reads.

Every linear layer except the output head gets `Int8WeightOnlyConfig` (per-row symmetric int8
weights with a scale per output channel; activations stay in the model dtype). Tensor subclasses
are flattened with torchao's safetensors support: each quantized weight `<module>.weight` is
stored as `<module>._weight_qdata` (int8), `<module>._weight_scale` and `<module>._weight_zero_point`,
and the file's metadata records how to rebuild it. `config.json` carries the
`quantization_config` (`quant_method: torchao`) that lets
`transformers.AutoModelForCausalLM.from_pretrained(folder)` rebuild the quantized model (needs
torchao installed); `torchao.prototype.safetensors.safetensors_support.unflatten_tensor_state_dict`
rebuilds the state dict without transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import nn
from torchao.core.config import config_to_dict
from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
from torchao.quantization import Int8WeightOnlyConfig, quantize_

from posttrain.model_files.hf import SAFE_SINGLE
from posttrain.models import Transformer

LOADING_NOTE = """# int8 weight-only copy

Produced by posttrain with torchao `Int8WeightOnlyConfig` (per-row int8 weights, one scale per
output channel; activations stay in `{dtype}`). All linear layers except `lm_head` are quantized;
embeddings and norms are unchanged.

Format: one safetensors file in torchao's flattened layout (`<module>._weight_qdata` int8,
`_weight_scale`, `_weight_zero_point`; the file metadata describes each tensor), with a
`quantization_config` of `quant_method: torchao` in `config.json`.

Load with transformers and torchao installed:

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("<this folder>")
```

Without transformers: read the file with `safetensors.safe_open`, then
`torchao.prototype.safetensors.safetensors_support.unflatten_tensor_state_dict(tensors, metadata)`.
"""


def _quantizable(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and fqn != "lm_head"


def quantization_config() -> dict[str, Any]:
    """The `quantization_config` transformers' `TorchAoConfig(Int8WeightOnlyConfig())` serializes to."""
    return {
        "quant_method": "torchao",
        "quant_type": {"default": config_to_dict(Int8WeightOnlyConfig())},
        "modules_to_not_convert": None,
        "include_input_output_embeddings": False,
        "untie_embedding_weights": False,
    }


def save_int8_copy(model: Transformer, export_dir: Path, out_dir: Path) -> None:
    """Quantize `model` in place and write it to `out_dir` with `export_dir`'s config files.

    `export_dir` holds the already written full-precision export (its `config.json` and
    `generation_config.json` are reused); the model's dtype is the activation dtype.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=_quantizable)
    state = model.state_dict()
    if model.args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors, metadata = flatten_tensor_state_dict(state)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / SAFE_SINGLE), metadata=metadata)
    config = json.loads((export_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "generation_config.json").write_text((export_dir / "generation_config.json").read_text())
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    (out_dir / "README.md").write_text(LOADING_NOTE.format(dtype=dtype))
