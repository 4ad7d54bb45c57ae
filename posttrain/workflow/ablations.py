"""The ablation table: one row a variant, columns of dotted config keys that override the base.

    variant     grpo.group_size   memory.optimizer_in_backward
    default
    g4          4                 true

Tab-separated; `#` lines and blank lines are ignored; an empty cell keeps the base value. A cell is
read as a YAML scalar (or flow list/mapping) and then fitted to the key's schema type, so `3e-4`
is a number for `sft.lr` and `null` clears `export.push_to_hub`. Every variant's config is then
validated whole. Problems name the file, the line, the variant and the column.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from posttrain.workflow.schema import (
    SCHEMA_DIR,
    ConfigError,
    Problem,
    load_schema,
    schema_at,
    schema_keys,
    schema_types,
    set_dotted,
    validate_config,
)
from posttrain.workflow.did_you_mean import suggest

DEFAULT_VARIANT = "default"
VARIANT_COLUMN = "variant"
# Keys that name where the sweep itself lives; a variant cannot move them.
WORKFLOW_KEYS = ("ablations", "results")


@dataclass(frozen=True)
class Variant:
    """A named config: the base config with `overrides` (dotted key -> value) applied and validated."""

    name: str
    config: dict[str, Any]
    overrides: dict[str, Any] = field(default_factory=dict)


def load_variants(cfg: Mapping[str, Any], schema_dir: str | Path = SCHEMA_DIR) -> dict[str, Variant]:
    """The variants of a validated config: its `ablations` table, or one `default` variant.

    `schema_dir` holds config.schema.yaml and ablations.schema.yaml (the workflow's own).
    """
    path = cfg.get("ablations")
    variants = read_ablations(path, cfg, schema_dir) if path else {}
    return variants or {DEFAULT_VARIANT: Variant(DEFAULT_VARIANT, copy.deepcopy(dict(cfg)))}


def parse_cell(text: str, node: Mapping[str, Any]) -> Any:
    """A cell's value for a key whose subschema is `node` (raises ValueError for bad YAML)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"cannot parse {text!r} as YAML ({str(err).splitlines()[0]})") from None
    types = schema_types(node)
    if isinstance(value, str) and types & {"number", "integer"}:
        # YAML 1.1 reads 3e-4 (no dot) as a string; the schema says it is a number.
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if "integer" in types and number.is_integer() else number
    if not isinstance(value, str) and "string" in types and not _matches_type(value, types):
        return text  # e.g. a model id or name that YAML would read as a number or boolean
    return value


def _matches_type(value: Any, types: set[str]) -> bool:
    checks = {
        "null": value is None,
        "boolean": isinstance(value, bool),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "string": isinstance(value, str),
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
    }
    return any(checks.get(t, False) for t in types)


def _lines(path: Path) -> list[tuple[int, list[str]]]:
    """(line number, tab-separated cells) of the table's non-comment, non-blank lines."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(str(path), [f"cannot read the ablation table: {err.strerror}"]) from None
    return [
        (number, [cell.strip() for cell in line.split("\t")])
        for number, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.lstrip().startswith("#")
    ]


def _header_problems(columns: list[str], schema: Mapping[str, Any], row_schema: Mapping[str, Any]) -> list[Problem]:
    problems = []
    if not columns or columns[0] != VARIANT_COLUMN:
        problems.append(Problem("line 1" if not columns else "column 1", f"the first column must be {VARIANT_COLUMN!r}"))
    seen: set[str] = set()
    for index, column in enumerate(columns, 1):
        where = f"column {index} {column!r}"
        if column in seen:
            problems.append(Problem(where, "appears twice"))
        seen.add(column)
        if column == VARIANT_COLUMN:
            continue
        if column in WORKFLOW_KEYS or column.split(".")[0] in WORKFLOW_KEYS:
            problems.append(Problem(where, f"{', '.join(WORKFLOW_KEYS)} cannot differ between variants"))
        elif not jsonschema.Draft202012Validator(row_schema["propertyNames"]).is_valid(column):
            problems.append(Problem(where, "is not a dotted config key such as sft.lr"))
        elif schema_at(column, schema) is None:
            problems.append(Problem(where, f"is not a config key{suggest(column, schema_keys(schema))}"))
    return problems


def read_ablations(path: str | Path, base: Mapping[str, Any], schema_dir: str | Path = SCHEMA_DIR) -> dict[str, Variant]:
    """Variants of the table at `path` over the validated `base` config, in table order.

    A table with only a header yields no variants. Raises ConfigError listing every bad cell.
    """
    path = Path(path)
    schema = load_schema(Path(schema_dir) / "config.schema.yaml")
    row_schema_doc = load_schema(Path(schema_dir) / "ablations.schema.yaml")
    rows = _lines(path)
    if not rows:
        return {}
    (header_line, columns), body = rows[0], rows[1:]
    problems = _header_problems(columns, schema, row_schema_doc)
    if problems:
        raise ConfigError(f"{path} line {header_line}", problems)

    row_schema = jsonschema.Draft202012Validator(row_schema_doc)
    variants: dict[str, Variant] = {}
    first_line: dict[str, int] = {}
    for line, cells in body:
        where = f"line {line}"
        if len(cells) > len(columns):
            problems.append(Problem(where, f"{len(cells)} cells but the header has {len(columns)} columns"))
            continue
        row = dict(zip(columns, cells))
        name = row.get(VARIANT_COLUMN, "")
        where = f"line {line} (variant {name!r})"
        if not row_schema.is_valid({VARIANT_COLUMN: name}):
            problems.append(Problem(
                f"line {line}, column {VARIANT_COLUMN!r}",
                f"variant name {name!r} must be 1-100 letters, digits, '_', '.', '-', starting with a letter or digit",
            ))
            continue
        if name in first_line:
            problems.append(Problem(where, f"duplicate variant name (first on line {first_line[name]})"))
            continue
        first_line[name] = line

        cfg = copy.deepcopy(dict(base))
        overrides: dict[str, Any] = {}
        for column, text in row.items():
            if column == VARIANT_COLUMN or text == "":
                continue
            try:
                overrides[column] = parse_cell(text, schema_at(column, schema))
            except ValueError as err:
                problems.append(Problem(f"{where}, column {column!r}", str(err)))
                continue
            set_dotted(cfg, column, overrides[column])
        try:
            only = {column.split(".")[0] for column in overrides}
            variants[name] = Variant(name, validate_config(cfg, where, schema, only=only), overrides)
        except ConfigError as err:
            problems.extend(_blame_columns(err.problems, overrides, where))
    if problems:
        raise ConfigError(str(path), problems)
    return variants


def _blame_columns(problems: list[Problem], overrides: Mapping[str, Any], where: str) -> list[Problem]:
    """Name the column whose override a problem lies under (a problem may also lie outside all)."""
    out = []
    for problem in problems:
        column = next((c for c in overrides if problem.key == c or problem.key.startswith((c + ".", c + "["))), None)
        label = f"{where}, column {column!r}" if column else where
        out.append(Problem(label, f"{problem.key}: {problem.message}" if column != problem.key else problem.message))
    return out
