"""Pipeline configs checked against workflow/schemas/config.schema.yaml.

The schema (JSON schema written in YAML) is the single statement of which keys exist, their types,
allowed values and defaults. Snakemake checks it through `snakemake.utils.validate`; this module
checks the same schema but reports every problem at once, each naming the dotted key and what is
allowed, fills defaults, and normalizes numbers (an integer where the schema says number becomes a
float) so equal configs hash equally in stage keys.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from posttrain.rules import config_problems
from posttrain.workflow.did_you_mean import suggest
from posttrain.workflow.model_names import grpo_start_family, preset_names
from posttrain.workflow.preflight import path_problems

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DIR = REPO_ROOT / "workflow" / "schemas"
CONFIG_SCHEMA = SCHEMA_DIR / "config.schema.yaml"
DEFAULT_CONFIG = REPO_ROOT / "config" / "config.yaml"


@dataclass(frozen=True)
class Problem:
    """One violation: where (a dotted key such as `sft.lr` or `data.tasks[0].name`) and what."""

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}" if self.key else self.message


class ConfigError(ValueError):
    """A config (or ablation table) that does not satisfy the schema; lists every problem."""

    def __init__(self, where: str, problems: Sequence[Problem | str]):
        self.where = where
        self.problems = [p if isinstance(p, Problem) else Problem("", p) for p in problems]
        if len(self.problems) == 1:
            text = f"{where}: {self.problems[0]}"
        else:
            text = f"{where}: {len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(text)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping from `path`; syntax errors and non-mappings raise ConfigError naming the file."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(str(path), [f"cannot read: {err.strerror}"]) from None
    except yaml.YAMLError as err:
        raise ConfigError(str(path), [f"invalid YAML: {err}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), [f"must be a mapping of config keys, got {type(data).__name__}"])
    return data


@functools.lru_cache(maxsize=None)
def _load_schema(path: str) -> dict[str, Any]:
    return load_yaml(path)


def load_schema(path: str | Path = CONFIG_SCHEMA) -> dict[str, Any]:
    """The parsed schema (cached; callers must not modify it)."""
    return _load_schema(str(Path(path).resolve()))


def merge(base: Mapping[str, Any], *overlays: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge as Snakemake merges `--configfile` overlays: mappings merge, anything else replaces."""
    out = copy.deepcopy(dict(base))
    for overlay in overlays:
        for key, value in overlay.items():
            if isinstance(value, Mapping) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out


def dotted(path: Iterable[str | int]) -> str:
    """`("data", "tasks", 0, "name")` -> `data.tasks[0].name`."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def get_dotted(cfg: Mapping[str, Any], key: str) -> Any:
    """The value at dotted `key` (KeyError when a part is missing)."""
    node: Any = cfg
    for part in key.split("."):
        node = node[part]
    return node


def set_dotted(cfg: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted `key` in place, creating intermediate mappings."""
    *parents, last = key.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def resolve_ref(node: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    """Follow a local `$ref` (`#/$defs/...`); the node's own keys (e.g. `default`) win."""
    ref = node.get("$ref")
    if ref is None:
        return node
    target: Any = root
    for part in ref.removeprefix("#/").split("/"):
        target = target[part]
    return {**resolve_ref(target, root), **{k: v for k, v in node.items() if k != "$ref"}}


def schema_at(key: str, schema: Mapping[str, Any] | None = None) -> Mapping[str, Any] | None:
    """The (ref-resolved) subschema of dotted `key`, or None when the schema has no such key."""
    root = schema if schema is not None else load_schema()
    node: Mapping[str, Any] = root
    for part in key.split("."):
        props = resolve_ref(node, root).get("properties", {})
        if part not in props:
            return None
        node = props[part]
    return resolve_ref(node, root)


def schema_keys(schema: Mapping[str, Any] | None = None) -> list[str]:
    """Every dotted key the schema defines (objects and leaves), for suggestions."""
    root = schema if schema is not None else load_schema()

    def walk(node: Mapping[str, Any], prefix: str) -> Iterator[str]:
        for name, sub in resolve_ref(node, root).get("properties", {}).items():
            key = f"{prefix}.{name}" if prefix else name
            yield key
            yield from walk(sub, key)

    return list(walk(root, ""))


def schema_types(node: Mapping[str, Any]) -> set[str]:
    """The JSON types a subschema accepts (from `type`, else from the values of `enum`/`const`)."""
    if "type" in node:
        types = node["type"]
        return {types} if isinstance(types, str) else set(types)
    values = node.get("enum", [node["const"]] if "const" in node else [])
    names = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string"}
    return {names.get(type(v), "object") for v in values}


def _show(value: Any) -> str:
    return json.dumps(value) if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


_BOUNDS = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}


def _problems(error: jsonschema.ValidationError, prefix: Sequence[str | int] = ()) -> list[Problem]:
    """Readable problems for one jsonschema error (`prefix`: the path of the validated instance)."""
    path = [*prefix, *error.absolute_path]
    key = dotted(path)
    kind, expected, value = error.validator, error.validator_value, error.instance
    if kind == "additionalProperties" and isinstance(value, Mapping):
        allowed = sorted(error.schema.get("properties", {}))
        where = f" under {key!r}" if key else ""
        return [
            Problem(dotted([*path, extra]), f"unknown key{suggest(str(extra), allowed)}; allowed keys{where}: {', '.join(allowed)}")
            for extra in sorted(set(value) - set(allowed), key=str)
        ]
    if kind == "required":
        return [Problem(dotted([*path, name]), "missing (required)") for name in expected if name not in value]
    if kind == "enum":
        return [Problem(key, f"{_show(value)} is not allowed; allowed values: {', '.join(_show(v) for v in expected)}")]
    if kind == "const":
        return [Problem(key, f"{_show(value)} is not allowed; expected {_show(expected)}")]
    if kind == "type":
        types = [expected] if isinstance(expected, str) else expected
        return [Problem(key, f"{_show(value)} is not of type {' or '.join(types)}")]
    if kind in _BOUNDS:
        return [Problem(key, f"{_show(value)} must be {_BOUNDS[kind]} {expected}")]
    if kind == "pattern":
        return [Problem(key, f"{_show(value)} does not match the pattern {expected}")]
    if kind in ("minItems", "maxItems"):
        return [Problem(key, f"{_show(value)} must have {'at least' if kind == 'minItems' else 'at most'} {expected} items")]
    return [Problem(key, error.message)]


def _fill_defaults(validator, props, instance, subschema):
    """The `properties` keyword, first setting each missing property that has a `default` (a copy)."""
    if validator.is_type(instance, "object"):
        for name, sub in props.items():
            if name not in instance and isinstance(sub, Mapping) and "default" in sub:
                instance[name] = copy.deepcopy(sub["default"])
    yield from jsonschema.Draft202012Validator.VALIDATORS["properties"](validator, props, instance, subschema)


_DefaultingValidator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"properties": _fill_defaults})
_validators: dict[int, tuple[Mapping[str, Any], Any]] = {}


def _validator(root: Mapping[str, Any]):
    """A 2020-12 validator of `root` that fills defaults (one per schema object)."""
    if id(root) not in _validators:
        _validators[id(root)] = (root, _DefaultingValidator(root))  # keeps root alive, so the id stays unique
    return _validators[id(root)][1]


def _normalize_numbers(value: Any, node: Mapping[str, Any], root: Mapping[str, Any]) -> Any:
    """Integers where the schema says number become floats; integral floats where it says integer, ints."""
    node = resolve_ref(node, root)
    if isinstance(value, dict):
        props = node.get("properties", {})
        return {k: _normalize_numbers(v, props[k], root) if k in props else v for k, v in value.items()}
    if isinstance(value, list):
        items = node.get("items")
        return [_normalize_numbers(v, items, root) for v in value] if isinstance(items, Mapping) else value
    if isinstance(value, bool):
        return value
    types = schema_types(node)
    if isinstance(value, int) and "number" in types and "integer" not in types:
        return float(value)
    if isinstance(value, float) and "integer" in types and "number" not in types and value.is_integer():
        return int(value)
    return value


def _semantic_problems(cfg: Mapping[str, Any]) -> list[Problem]:
    """Once the schema holds: the rules between keys (`posttrain.rules`, what the stages would refuse when they
    start among them) and what the config names that does not exist or does not load (`preflight`), before any
    job is queued."""
    grpo_start = grpo_start_family(cfg) if cfg["reward_model"]["source"] == "train" else None
    return [Problem(key, message)
            for key, message in config_problems(cfg, preset_names(), grpo_start) + path_problems(cfg)]


def _schema_problems(cfg: dict[str, Any], validator: Any) -> list[Problem]:
    """The schema's problems with `cfg` (its defaults filled in, in place)."""
    return [p for error in validator.iter_errors(cfg) for p in _problems(error)]


def schema_problems(cfg: Mapping[str, Any], schema: Mapping[str, Any] | None = None) -> list[Problem]:
    """Keys, types and allowed values alone, without the cross-key rules and the files they read: what a config
    shown in the docs must pass even where the files it names are the reader's own."""
    root = schema if schema is not None else load_schema()
    return sorted(_schema_problems(copy.deepcopy(dict(cfg)), _validator(root)), key=lambda p: p.key)


def validate_config(
    cfg: Mapping[str, Any],
    where: str = "config",
    schema: Mapping[str, Any] | None = None,
    only: Iterable[str] | None = None,
) -> dict[str, Any]:
    """A checked copy of `cfg` with defaults filled and numbers normalized; raises ConfigError.

    `where` names the source in the message (a file, or `ablations.tsv line 3`). `only` limits the
    schema check to these top-level keys, for a config known valid elsewhere (an ablation variant:
    its base passed, only the overridden sections can break); cross-key rules always run.
    """
    root = schema if schema is not None else load_schema()
    out = copy.deepcopy(dict(cfg))
    validator = _validator(root)
    if only is None:
        problems = _schema_problems(out, validator)
        out = _normalize_numbers(out, root, root)
    else:
        problems = []
        for section in sorted(set(only)):
            node = root["properties"][section]
            problems += [p for error in validator.evolve(schema=node).iter_errors(out[section]) for p in _problems(error, [section])]
            out[section] = _normalize_numbers(out[section], node, root)
    problems = sorted(problems, key=lambda p: p.key) or _semantic_problems(out)
    if problems:
        raise ConfigError(where, problems)
    return out


def load_config(*paths: str | Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Merge YAML files (later ones overlay earlier ones, as `--configfile` does) and validate.

    With no paths the default config/config.yaml is used.
    """
    paths = paths or (DEFAULT_CONFIG,)
    cfg = merge(*(load_yaml(p) for p in paths), overrides or {})
    return validate_config(cfg, where=" + ".join(str(p) for p in paths))
