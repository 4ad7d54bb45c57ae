"""What planning knows of the models without importing torch: the preset names and the architectures the
native model builds. `posttrain/models/presets.py` and `args.py` import nothing of torch, but the package's
`__init__` imports the model code: they are loaded here as plain files, so a dry run stays light."""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

MODELS = Path(__file__).resolve().parents[1] / "models"


@cache
def _leaf(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_posttrain_models_{name}", MODELS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def preset_names() -> tuple[str, ...]:
    return tuple(_leaf("presets").PRESETS)


def supported_model_types() -> tuple[str, ...]:
    return tuple(_leaf("args").SUPPORTED_MODEL_TYPES)


def backend_problem(hf_config: dict, backend: str, source: str) -> str | None:
    """Why `model.backend` cannot run `hf_config` (`args.model_backend`'s refusal), or None."""
    args = _leaf("args")
    try:
        args.model_backend(hf_config, backend, source)
    except args.ModelConfigError as e:
        return str(e)
    return None
