"""What `reward.verifiers` and `reward_model` name, torch-free: the dry run loads this file by itself.

A `reward.verifiers` entry is a name or ``{fn: name, weight: w, batched: b}`` (`reward_spec`). A name is a
built-in verifier (`BUILTIN_VERIFIERS`), ``package.module:function`` (imported from the working directory,
the checkout or PYTHONPATH) or ``path/file.py:function``: a file relative to the working directory (the
workflow's, where Snakemake runs and the stages start), executed as a module of its own (`load_file_module`).
`reward_model.source` is null, ``train`` (the reward_model stage) or a pretrained folder or hub id
(`pretrained_source`), whose config must declare a sequence classifier with one label
(`sequence_classifier_problem`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

BUILTIN_VERIFIERS = ("task", "math", "number", "list", "format", "reasoning_gym", "environment", "arithmetic", "sort",
                     "reverse")
ENTRY_KEYS = ("fn", "weight", "batched")


@dataclass(frozen=True)
class RewardSpec:
    """One `reward.verifiers` entry: the function's name, its weight in the reward, and how it is called."""

    name: str  # a built-in, `package.module:function` or `path/file.py:function`
    weight: float = 1.0
    batched: bool = False  # fn(completions, examples) -> list[float], once per batch

    @property
    def module(self) -> str | None:
        """`package.module` or `path/file.py` of a user function; None for a built-in."""
        module, sep, _ = self.name.rpartition(":")
        return module if sep and self.name not in BUILTIN_VERIFIERS else None

    @property
    def attr(self) -> str:
        return self.name.rpartition(":")[2]

    @property
    def is_file(self) -> bool:
        return bool(self.module) and self.module.endswith(".py")


def reward_spec(entry: str | Mapping[str, Any] | RewardSpec) -> RewardSpec:
    """A `reward.verifiers` entry as a `RewardSpec`: a name (weight 1, one sample at a time), or a mapping
    ``{fn: name, weight: w, batched: b}``."""
    if isinstance(entry, RewardSpec):
        return entry
    if isinstance(entry, str):
        return RewardSpec(entry)
    if isinstance(entry, Mapping):
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        if unknown or not isinstance(entry.get("fn"), str):
            raise ValueError(f"verifier entry {dict(entry)!r}: expected {{fn: name, weight: number, batched: bool}}")
        return RewardSpec(entry["fn"], float(entry.get("weight", 1.0)), bool(entry.get("batched", False)))
    raise TypeError(f"verifier entry {entry!r}: expected a name or {{fn: name, weight: number, batched: bool}}")


def verifier_name(entry: str | Mapping[str, Any] | RewardSpec) -> str:
    """The name an entry's scores go by (`reward/<name>` columns, `reward_by_verifier`): its function's."""
    return reward_spec(entry).name


def reward_specs(entries: Sequence[str | Mapping[str, Any] | RewardSpec]) -> list[RewardSpec]:
    """The entries of a config list such as ``reward.verifiers`` as `RewardSpec`s; their functions must be distinct."""
    specs = [reward_spec(e) for e in entries]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"verifiers: duplicate entries in {names!r}")
    return specs


def user_module_file(path: str, workdir: str | os.PathLike | None = None) -> Path:
    """The file of a `path/file.py:function` spec: `path` relative to `workdir` (the working directory)."""
    return (Path(workdir if workdir is not None else os.getcwd()) / Path(path).expanduser()).resolve()


def load_file_module(file: Path) -> ModuleType:
    """Execute a user's reward file as a module of its own (named by its path, so two `rewards.py` do not meet).

    Its folder is first on `sys.path` while it runs (it may import the modules beside it) and last afterwards
    (imports inside its functions still find them, but they never hide an installed module of the same name).
    """
    name = f"posttrain_user_{re.sub(r'[^0-9A-Za-z_]', '_', file.stem)}_{hashlib.sha256(str(file).encode()).hexdigest()[:10]}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"{file}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look a module up there
    folder = str(file.parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        sys.path.remove(folder)
        if folder not in sys.path:
            sys.path.append(folder)
    return module


def user_function(spec: RewardSpec, workdir: str | os.PathLike | None, kind: str = "verifier") -> Any:
    """The callable a user's `module:function` or `path/file.py:function` names (ImportError/TypeError name the spec,
    as a `kind`: a verifier, an environment)."""
    if spec.is_file:
        file = user_module_file(spec.module, workdir)
        if not file.is_file():
            raise ImportError(f"{kind} {spec.name!r}: no such file {file} (a path is relative to the working directory)")
        try:
            module = load_file_module(file)
        except ImportError as e:
            raise ImportError(f"{kind} {spec.name!r}: cannot import {file}: {e}") from e
        where = str(file)
    else:
        try:
            module = importlib.import_module(spec.module)
        except ImportError as e:
            raise ImportError(f"{kind} {spec.name!r}: cannot import module {spec.module!r}: {e}") from e
        where = f"module {spec.module!r}"
    fn: Any = module
    for part in spec.attr.split("."):
        if not hasattr(fn, part):
            raise ImportError(f"{kind} {spec.name!r}: {where} has no attribute {spec.attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"{kind} {spec.name!r}: {spec.attr!r} is not callable")
    return fn


# --- reward_model.source --------------------------------------------------------------------

RM_SOURCES = (None, "train")  # values that name no folder: none, or the reward_model stage's
RM_NORMALIZE = ("group", "none")


def pretrained_source(source: str | None) -> str | None:
    """`reward_model.source` when it names a pretrained model: a local folder as an absolute path (a Ray actor
    may run elsewhere), a hub id as is (resolved through the Hugging Face cache where it is loaded); else None."""
    if source in RM_SOURCES:
        return None
    local = Path(source).expanduser()
    return str(local.resolve()) if local.exists() else source


def declares_classifier(config: Mapping[str, Any]) -> bool:
    """Whether an HF config.json is a sequence classifier's (a reward model folder) rather than a causal LM's."""
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or [])


def sequence_classifier_problem(config: Mapping[str, Any], where: str) -> str | None:
    """Why an HF config is no reward model (None when it declares a `*ForSequenceClassification` with one label)."""
    if not declares_classifier(config):
        return (f"{where}: architectures {list(config.get('architectures') or [])} declare no sequence-classification "
                "head (*ForSequenceClassification); a reward model scores with one")
    # transformers' rule: num_labels, else the size of id2label, else its default of 2
    labels = int(config["num_labels"]) if "num_labels" in config else len(config.get("id2label") or {0: 0, 1: 1})
    if labels != 1:
        return f"{where}: num_labels is {labels}; a reward model has 1 (one scalar score)"
    return None


def read_json_config(path: Path) -> dict[str, Any] | None:
    """A config.json as a mapping, or None when it cannot be read as one."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
