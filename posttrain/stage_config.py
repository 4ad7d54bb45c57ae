"""The config a stage script runs with: its resolved config and its run settings, behind a guard.

The workflow writes two files per planned output (docs/workflow.md, "What a key covers"):

- `<key>.config.json`, the RESOLVED config: the settings the key covers (the config keys the
  stage declares in its `READS`), everything its upstream stages got, `stage`, `key`,
  `upstream` and `code` (the code fingerprint). A rule input: a pure function of the key.
- `<key>.run.json`, the run settings (`loggers`, the stage section's `resources`, `log_every`,
  `checkpoint_every`): how the job runs, not what it computes. Not a rule input, so changing
  them reruns nothing.

`load_stage_config` merges both into a `StageConfig`, which refuses to read a key the stage did
not declare: a read that escaped `READS` would change the output without changing the key. A
config written by hand (tests, a stage run alone) may hold both kinds of settings in one file.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.utils.io import read_json
from posttrain.utils.manifest import require_intact

RESOLVED_KEYS = ("stage", "key", "upstream")  # every resolved config has them
META_KEYS = (*RESOLVED_KEYS, "code", "files")  # what the workflow adds; readable without a declaration
RUN_KEYS = ("loggers",)  # top-level run settings
RUN_SECTION_KEYS = ("resources", "log_every", "checkpoint_every")  # run settings of each config section
CONFIG_SUFFIX, RUN_SUFFIX = ".config.json", ".run.json"


class UndeclaredConfigKeyError(RuntimeError):
    """A stage read a config key missing from its `READS` (not a KeyError: `.get` must not swallow it)."""


def is_run_setting(dotted: str) -> bool:
    """Whether a dotted key is a run setting: `loggers` or `<section>.resources|log_every|checkpoint_every`."""
    parts = dotted.split(".")
    return (len(parts) == 1 and parts[0] in RUN_KEYS) or (len(parts) == 2 and parts[1] in RUN_SECTION_KEYS)


def run_settings_path(config_path: str | Path) -> Path | None:
    """`<key>.run.json` next to `<key>.config.json`; None for a config file named otherwise."""
    path = Path(config_path)
    if not path.name.endswith(CONFIG_SUFFIX):
        return None
    return path.with_name(path.name.removesuffix(CONFIG_SUFFIX) + RUN_SUFFIX)


def _read_json_object(path: Path, what: str) -> dict[str, Any]:
    value = read_json(path, f"the {what} file (the workflow writes it when it plans the stage)")
    if not isinstance(value, dict):
        raise ValueError(f"{what} {path}: must be a JSON object, got {type(value).__name__}")
    return value


def _read_resolved(path: Path) -> dict[str, Any]:
    """RESOLVED.json as a plain dict; it must name `stage`, `key` and `upstream`."""
    cfg = _read_json_object(path, "resolved config")
    missing = [k for k in RESOLVED_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"resolved config {path}: missing key(s) {', '.join(missing)}")
    return cfg


def deep_union(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """`a` with `b` merged in, section by section (`b` wins on a leaf)."""
    out = dict(a)
    for key, value in b.items():
        both = isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
        out[key] = deep_union(out[key], value) if both else value
    return out


class StageConfig(Mapping[str, Any]):
    """A stage's config, readable only where the stage declared it (plus `META_KEYS` and run settings).

    A declared key (`"sft"`, `"model.policy"`) opens its whole subtree; the sections on the way to
    a declared key (`model` for `model.policy`) come back as guarded views; any other read raises
    `UndeclaredConfigKeyError` naming the stage, the dotted key and the script. Iteration lists the
    readable keys only. `resolved` is the whole merged dict, for records (provenance, loggers).
    """

    def __init__(self, data: Mapping[str, Any], reads: Sequence[str], script: str | Path, where: str = ""):
        self._data, self._reads, self._script, self._where = data, tuple(reads), str(script), where
        self._prefix = ""
        self.stage = str(data.get("stage", "?"))

    def _child(self, data: Mapping[str, Any], prefix: str) -> StageConfig:
        view = copy.copy(self)
        view._data, view._prefix = data, prefix
        return view

    @property
    def resolved(self) -> dict[str, Any]:
        return dict(self._data)

    def _covered(self, dotted: str) -> bool:
        top = dotted.split(".")[0]
        return (top in META_KEYS or is_run_setting(dotted)
                or any(dotted == r or dotted.startswith(r + ".") for r in self._reads))

    def _partly_declared(self, dotted: str) -> bool:
        return any(r.startswith(dotted + ".") for r in self._reads)

    def __getitem__(self, key: str) -> Any:
        dotted = f"{self._prefix}.{key}" if self._prefix else key
        covered, partly = self._covered(dotted), self._partly_declared(dotted)
        if (covered or partly) and key not in self._data:
            raise KeyError(f"config key {dotted!r} is missing from {self._where or 'the config'}")
        value = self._data.get(key)
        if covered:
            return value
        # On the way to a declared key, or an undeclared section: a view whose keys are checked one
        # by one, so that the error names the key read (`sft.lr`), not only its section.
        if isinstance(value, Mapping) and (partly or not self._prefix):
            return self._child(value, dotted)
        raise UndeclaredConfigKeyError(
            f"stage {self.stage!r} reads config key {dotted!r}, which {self._script} does not declare in READS; "
            f"add {dotted!r} (or its section) to READS so that it enters the stage key"
        )

    def __iter__(self) -> Iterator[str]:
        for key in self._data:
            dotted = f"{self._prefix}.{key}" if self._prefix else key
            if self._covered(dotted) or self._partly_declared(dotted):
                yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"StageConfig({self.stage!r}, {self._prefix or 'root'}: {dict(self)!r})"


def as_dict(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The plain dict of a config: a `StageConfig`'s whole merged config, any other mapping as is."""
    return cfg.resolved if isinstance(cfg, StageConfig) else dict(cfg)


def load_stage_config(path: str | Path, reads: Sequence[str], script: str | Path) -> StageConfig:
    """The resolved config at `path` merged with its run settings (`<key>.run.json`, when there is one),
    guarded by the stage's `reads` (its `READS`); `script` is named in the guard's errors."""
    path = Path(path)
    cfg = _read_resolved(path)
    where = str(path)
    run_path = run_settings_path(path)
    if run_path is not None and run_path.is_file():
        cfg = deep_union(cfg, _read_json_object(run_path, "run settings"))
        where = f"{path} and {run_path}"
    return StageConfig(cfg, reads, script, where)


def parse_inputs(stage: str, inputs: Mapping[str, str], optional: tuple[str, ...] = (),
                 repeatable: tuple[str, ...] = ()) -> argparse.Namespace:
    """`--config`, `--out` and the stage's input folders/files (`inputs`: flag -> help; `optional` ones may be
    absent; `repeatable` ones may be given any number of times, none included, and come back as a list)."""
    parser = argparse.ArgumentParser(prog=f"stages/{stage}.py", description=f"the {stage} stage of posttrain")
    parser.add_argument("--config", required=True, help="resolved config (JSON)")
    parser.add_argument("--out", required=True, help="output folder (the workflow's results/<stage folder>/<key>)")
    for name, text in inputs.items():
        if name in repeatable:
            parser.add_argument(f"--{name}", action="append", default=[], help=f"{text} (repeatable)")
        else:
            parser.add_argument(f"--{name}", required=name not in optional, help=text)
    args = parser.parse_args()
    for name in inputs:  # an upstream output read as damaged weights or rows would train wrong in silence
        values = getattr(args, name)
        for value in values if isinstance(values, list) else [values]:
            if value and Path(value).is_dir():
                require_intact(Path(value), f"the input --{name}")
    return args
