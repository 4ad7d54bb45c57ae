"""Config overrides from `snakemake --config`, typed by the schema.

Snakemake takes only identifiers as `--config` keys (`sft.lr=1e-3` is refused before the Snakefile runs)
and reads nested values as strings (`sft={steps: 2}` gives "2"). So:

    snakemake --config 'set=sft.lr=1e-3; grpo.group_size=4; pipeline=[sft, grpo]'   dotted keys, `;` between
    snakemake --config 'sft={lr: 1e-3, steps: 2}' eval='{base: true}'               whole sections

Each value is read as an ablation-table cell is (`ablations.parse_cell`: YAML, then fitted to the key's
schema type), so `2` is an integer for `sft.steps`, `1e-3` a number and `[sft, grpo]` a list; the
config is then validated whole, and a bad key or value is named there.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from posttrain.workflow.ablations import parse_cell
from posttrain.workflow.schema import ConfigError, Problem, resolve_ref, schema_at, set_dotted

SET_KEY = "set"  # --config set='a.b=1; c=2'


def _fit(value: Any, node: Mapping[str, Any] | None, root: Mapping[str, Any]) -> Any:
    """`value` as Snakemake parsed it, typed by the subschema `node` (None: a key the schema lacks, left as is)."""
    if node is None:
        return value
    if isinstance(value, str):
        return parse_cell(value, node)
    if isinstance(value, list):
        items = resolve_ref(node["items"], root) if isinstance(node.get("items"), Mapping) else None
        return [_fit(v, items, root) for v in value]
    if isinstance(value, dict):
        props = node.get("properties", {})
        return {k: _fit(v, resolve_ref(props[k], root) if k in props else None, root) for k, v in value.items()}
    return value


def dotted_leaves(value: Any, prefix: str) -> list[tuple[str, Any]]:
    """(dotted key, value) of each leaf of `value` under `prefix`: a `--config` section given sets only the keys it
    names, and two configs' sections compare key by key."""
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in dotted_leaves(v, f"{prefix}.{k}")]
    return [(prefix, value)]


def dotted_assignments(text: str) -> dict[str, str]:
    """`"a.b=1; c=[x, y]"` -> {"a.b": "1", "c": "[x, y]"}; raises ConfigError for an entry without `=`."""
    out = {}
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        key, sep, value = entry.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--config {SET_KEY}=...", [Problem(entry, "expected key=value, e.g. sft.lr=1e-3")])
        out[key.strip()] = value.strip()
    return out


def apply_command_line(config: Mapping[str, Any], cli: Mapping[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    """`config` (files and `--config` already merged by Snakemake) with the `--config` values `cli` typed."""
    out = copy.deepcopy(dict(config))
    out.pop(SET_KEY, None)
    for top, value in cli.items():
        if top == SET_KEY:
            continue
        for key, leaf in dotted_leaves(value, top):
            set_dotted(out, key, _fit(leaf, schema_at(key, schema), schema))
    assignments = dotted_assignments(str(cli[SET_KEY])) if cli.get(SET_KEY) is not None else {}
    problems = []
    for key, text in assignments.items():
        node = schema_at(key, schema)
        if node is None:
            problems.append(Problem(key, "is not a config key"))
            continue
        try:
            set_dotted(out, key, parse_cell(text, node))
        except ValueError as err:
            problems.append(Problem(key, str(err)))
    if problems:
        raise ConfigError(f"--config {SET_KEY}=...", problems)
    return out
