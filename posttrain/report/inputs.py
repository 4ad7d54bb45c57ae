"""What the report stage reads (its checked config, each curve stage's records), out of the script so tests can call it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posttrain.report.curves import OBJECTIVES
from posttrain.report.summary import stage_records
from posttrain.stage_config import StageConfig, load_stage_config

MANIFEST_KEYS = ("stages", "eval", "previous")


def read_report_config(path: str, reads: Sequence[str], script: str | Path) -> StageConfig:
    """The report config at `path`, guarded by the stage's `reads`: a non-empty `variants` mapping whose
    every manifest names its `MANIFEST_KEYS`."""
    cfg = load_stage_config(path, reads, script)
    if not isinstance(cfg.get("variants"), dict) or not cfg["variants"]:
        raise ValueError(f"report config {path}: needs a non-empty 'variants' mapping (name -> manifest)")
    for name, manifest in cfg["variants"].items():
        missing = [k for k in MANIFEST_KEYS if k not in manifest]
        if missing:
            raise ValueError(f"report config {path}: variant {name!r} lacks {', '.join(missing)}")
    return cfg


def stage_runs(variants: dict[str, Any]) -> dict[str, dict[str, tuple[list[str], list[dict]]]]:
    """{stage: {key: (variant names, metrics.jsonl records)}} of the stages with objective curves:
    each stage output read once."""
    runs: dict[str, dict[str, tuple[list[str], list[dict]]]] = {}
    for name, manifest in variants.items():
        for stage, ref in manifest["stages"].items():
            if stage not in OBJECTIVES:
                continue
            by_key = runs.setdefault(stage, {})
            if ref["key"] not in by_key:
                by_key[ref["key"]] = ([], stage_records(ref["path"]))
            by_key[ref["key"]][0].append(name)
    return runs
