"""What a user brings, as it enters stage keys: local data and model folders by content, hub ids by revision,
reward functions by code.

A stage's key covers every file it reads (docs/workflow.md, "What a key covers"): our code by its
fingerprint, upstream outputs by their keys, and what the user brings by `user_inputs`:

- `data.sources[i].path` (data prep): a local file or folder by the sha256 of its bytes; a hub dataset
  id by the revision the local Hugging Face cache resolves it to (or the requested one).
- `model.policy`, `model.student` (the stages that build from them): a local folder by its content, a
  hub id by its cached revision; a preset is our code. Data prep reads a model folder only for its
  tokenizer (`model.tokenizer`, else `model.policy`), so only the tokenizer files enter its key: a
  changed weight reruns SFT, not data prep.
- `reward.verifiers` entries `module:function` and `path/file.py:function` (a file relative to the working
  directory): the module's code and that of the modules it imports from beside it, fingerprinted like
  ours (comments and docstrings aside); an installed package by its name and version.
- `environment.fn`, a user environment `module:Class` or `path/file.py:Class` (GRPO): its code, as a reward
  function's.
- `reward_model.source`, a pretrained reward model (the reward and grpo stages): a local folder by its
  content, a hub id by its cached revision, like `model.policy`.

A folder's content is the hash of its files' relative paths and hashes; names starting with `.`
(`.git`, `.cache`) are skipped. File hashes are cached by path, size, mtime and inode (as git's
index and DVC do), so planning over a large dataset reads it once, and a touch that changes no byte
moves no key.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.machinery
import importlib.metadata
import json
import os
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.tokenizer import TOKENIZER_FILES  # what data prep reads of a model folder
from posttrain.utils.io import file_sha256
from posttrain.workflow.fingerprint import fingerprint, module_hashes

HASH_LENGTH = 16
CACHE_FILE = ".posttrain/content-hashes.json"  # under the results directory
TOKENIZER_STAGES = ("prepare_data",)  # read model folders for their tokenizer only
MODEL_KEYS = ("policy", "student")


@dataclass
class ContentHashes:
    """sha256 of local files, remembered by (size, mtime, inode) in `path` (a JSON file; None: this process only)."""

    path: Path | None = None
    _known: dict[str, list[Any]] = field(default_factory=dict)  # absolute path -> [size, mtime_ns, inode, sha256]
    _changed: bool = False

    def __post_init__(self) -> None:
        if self.path is not None and self.path.is_file():
            try:
                known = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                known = {}  # a damaged cache costs a rehash, never a wrong key
            self._known = known if isinstance(known, dict) else {}

    def file(self, path: Path) -> str:
        stat = path.stat()
        stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
        name = str(path.resolve())
        known = self._known.get(name)
        if isinstance(known, list) and known[:3] == stamp:
            return known[3]
        digest = file_sha256(path)
        self._known[name] = [*stamp, digest]
        self._changed = True
        return digest

    def folder(self, path: Path, patterns: Sequence[str] | None = None) -> tuple[str, int]:
        """(hash, file count) of the folder's files (those matching `patterns`, when given)."""
        entries = {}
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in files:
                if name.startswith(".") or (patterns and not any(fnmatch.fnmatch(name, p) for p in patterns)):
                    continue
                file = Path(root, name)
                entries[file.relative_to(path).as_posix()] = self.file(file)
        text = json.dumps(entries, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:HASH_LENGTH], len(entries)

    def save(self) -> None:
        """Write the cache when something new was hashed (atomically: concurrent planners each write whole)."""
        if self.path is None or not self._changed:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self._known, sort_keys=True), encoding="utf-8")
        os.replace(tmp, self.path)
        self._changed = False


def stage_pythonpath(repo: str | os.PathLike) -> list[str]:
    """What the launcher puts before PYTHONPATH for every stage: the checkout and the working directory."""
    return [str(Path(repo).resolve()), os.getcwd()]


def code_search_path(repo: str | os.PathLike) -> list[str]:
    """Where a stage finds a user's `module:function`: `stage_pythonpath`, then PYTHONPATH."""
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [*stage_pythonpath(repo), *extra]


def find_module_file(module: str, search: Sequence[str]) -> Path | None:
    """The file of `module` (dotted) on `search` or, after it, the interpreter's path, without importing it."""
    import sys

    locations: list[str] | None = [*search, *sys.path]
    spec = None
    for part in module.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part if spec is None else f"{spec.name}.{part}", locations)
        if spec is None:
            return None
        locations = list(spec.submodule_search_locations or [])
    return Path(spec.origin) if spec and spec.origin and spec.has_location else None


def _installed_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    return [Path(paths[k]).resolve() for k in ("purelib", "platlib", "stdlib", "platstdlib") if k in paths]


def code_record(module: str, search: Sequence[str], workdir: str | os.PathLike | None = None) -> dict[str, Any]:
    """A user module's record: its code (and that of the modules beside it that it imports), or for an
    installed package its distribution and version. `module` is dotted, or a `path/file.py` relative to
    `workdir` (the working directory). Raises LookupError when the module is nowhere."""
    if module.endswith(".py"):
        file = (Path(workdir if workdir is not None else os.getcwd()) / Path(module).expanduser()).resolve()
        if not file.is_file():
            raise LookupError(f"reward file {module!r}: no such file {file} (relative to the working directory)")
        hashes = module_hashes(file, file.parent, package=None)
        return {"file": module, "path": str(file), "code": fingerprint(hashes), "modules": hashes}
    file = find_module_file(module, search)
    if file is None:
        raise LookupError(f"module {module!r} is not in the checkout, the working directory or PYTHONPATH")
    file = file.resolve()
    if any(file.is_relative_to(root) for root in _installed_roots()):
        top = module.split(".")[0]
        dists = importlib.metadata.packages_distributions().get(top, [])
        versions = {d: importlib.metadata.version(d) for d in dists}
        return {"module": module, "installed": versions or {"python": sysconfig.get_python_version()}}
    root = file.parents[len(module.split(".")) - (0 if file.name == "__init__.py" else 1)]
    hashes = module_hashes(file, root, package=None)
    return {"module": module, "path": str(file), "code": fingerprint(hashes), "modules": hashes}


def hub_revision(repo_id: str, revision: str | None, kind: str) -> dict[str, Any]:
    """A hub id with the commit the local cache resolves `revision` to (None when the cache does not know it)."""
    from huggingface_hub import constants

    commit = None
    if revision and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
        commit = revision
    else:
        ref = Path(constants.HF_HUB_CACHE) / f"{kind}s--{repo_id.replace('/', '--')}" / "refs" / (revision or "main")
        if ref.is_file():
            commit = ref.read_text().strip() or None
    return {"hub": repo_id, "kind": kind, "revision": revision, "commit": commit}


def _local_record(path: Path, hashes: ContentHashes, patterns: Sequence[str] | None = None) -> dict[str, Any]:
    if path.is_dir():
        digest, files = hashes.folder(path, patterns)
        return {"path": str(path.resolve()), "sha256": digest, "files": files}
    return {"path": str(path.resolve()), "sha256": hashes.file(path)[:HASH_LENGTH]}


def model_record(source: str, hashes: ContentHashes, presets: Sequence[str], tokenizer_only: bool = False) -> dict[str, Any] | None:
    """A model (or tokenizer) source's record: None for a preset (our code), its content for a folder."""
    if source in presets:
        return None
    path = Path(source).expanduser()
    if path.exists():
        return _local_record(path, hashes, TOKENIZER_FILES if tokenizer_only else None)
    return hub_revision(source, None, "model")


def without_unread_policy(stage: str, settings: dict[str, Any]) -> dict[str, Any]:
    """A tokenizer stage's settings without `model.policy` when `model.tokenizer` names the tokenizer: the policy is
    then not read, so variants of other policies with one tokenizer share the data preparation."""
    model = settings.get("model", {})
    if stage in TOKENIZER_STAGES and model.get("tokenizer") and "policy" in model:
        settings = {**settings, "model": {k: v for k, v in model.items() if k != "policy"}}
    return settings


def user_inputs(stage: str, settings: Mapping[str, Any], hashes: ContentHashes, presets: Sequence[str],
                search: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Dotted config key -> record, for every file the user brings that `stage` reads (`settings`: its READS)."""
    out: dict[str, dict[str, Any]] = {}
    model = settings.get("model", {})
    if stage in TOKENIZER_STAGES:
        name = "tokenizer" if model.get("tokenizer") else "policy"
        record = model_record(model[name], hashes, presets, tokenizer_only=True) if name in model else None
        if record:
            out[f"model.{name}"] = record
        template = model.get("chat_template")
        if template and Path(template).expanduser().is_file():  # a file; a named template is in the code
            out["model.chat_template"] = _local_record(Path(template).expanduser(), hashes)
    else:
        for name in MODEL_KEYS:
            record = model_record(model[name], hashes, presets) if name in model else None
            if record:
                out[f"model.{name}"] = record
    for i, source in enumerate(settings.get("data", {}).get("sources", [])):
        path = Path(source["path"]).expanduser()
        out[f"data.sources[{i}].path"] = (_local_record(path, hashes) if path.exists()
                                          else hub_revision(source["path"], source.get("revision"), "dataset"))
    for i, entry in enumerate(settings.get("reward", {}).get("verifiers", [])):
        name = entry if isinstance(entry, str) else entry["fn"]
        module, sep, _ = name.rpartition(":")
        if sep:
            out[f"reward.verifiers[{i}]"] = code_record(module, search)
    module, sep, _ = str(settings.get("environment", {}).get("fn") or "").rpartition(":")
    if sep:  # a user environment's code
        out["environment.fn"] = code_record(module, search)
    source = settings.get("reward_model", {}).get("source")
    if source not in (None, "train"):  # a pretrained reward model: its weights and tokenizer
        out["reward_model.source"] = model_record(source, hashes, ())
    return out
