"""What planning knows of the models without importing torch: the preset names and the architectures the
native model builds. `posttrain/models/presets.py`, `args.py` and `families.py` import nothing of torch, but the
package's `__init__` imports the model code: they are loaded here as plain files, so a dry run stays light."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

MODELS = Path(__file__).resolve().parents[1] / "models"
_PACKAGE = "_posttrain_models"  # the models folder as a package without its `__init__` (which imports torch)


@cache
def _leaf(name: str) -> ModuleType:
    """`posttrain/models/<name>.py` as a module of `_PACKAGE`, so its relative imports (args.py's families) load
    the sibling files alone."""
    if _PACKAGE not in sys.modules:
        package = ModuleType(_PACKAGE)
        package.__path__ = [str(MODELS)]
        sys.modules[_PACKAGE] = package
    return importlib.import_module(f"{_PACKAGE}.{name}")  # in sys.modules: dataclasses look their module up there


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


def grpo_start_family(cfg: Mapping[str, Any]) -> tuple[str, str] | None:
    """(model_type, "native" or "transformers": what `model.backend` runs it on) of the model GRPO starts from, which a
    trained reward model is built on: `model.student` when distill comes before grpo in `pipeline`, else `model.policy`.
    None where that is not known here: a config.json that cannot be read or run (the model check says why), a hub id
    not in the local cache."""
    pipeline = list(cfg["pipeline"])
    student = "distill" in pipeline and "grpo" in pipeline and pipeline.index("distill") < pipeline.index("grpo")
    source = str(cfg["model"]["student" if student else "policy"])
    presets, args = _leaf("presets").PRESETS, _leaf("args")
    config = presets[source] if source in presets else _config_json(source)
    if not isinstance(config, dict):
        return None
    try:
        return str(config.get("model_type")), args.model_backend(config, cfg["model"]["backend"], source)
    except args.ModelConfigError:
        return None


def hub_file(repo_id: str, filename: str) -> Path | None:
    """The cached copy of a hub repo's file, or None (never a download)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, filename)
    except ValueError:  # not a valid repo id
        return None
    return Path(found) if isinstance(found, str) else None


def _config_json(source: str) -> Any:
    """The parsed config.json of a local folder or a cached hub id (never a download); None where there is none."""
    folder = Path(source).expanduser()
    path = folder / "config.json" if folder.is_dir() else hub_file(source, "config.json")
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path else None
    except (OSError, ValueError):
        return None
