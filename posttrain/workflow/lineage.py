"""A stage output's lineage: the chain of `posttrain.json` records through its upstream keys.

Stage outputs live at `<results>/<stage dir>/<key>/` (`posttrain.workflow.layout.STAGE_DIRS`), and
each `posttrain.json` names its inputs as `upstream: {stage: key}`, so the folders an output was
built from are found next to it without any other index.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.utils.io import PROVENANCE_FILE, read_json
from posttrain.workflow.layout import STAGE_DIRS


def read_provenance(folder: str | Path) -> dict[str, Any]:
    """The folder's `posttrain.json` record."""
    path = Path(folder) / PROVENANCE_FILE
    record = read_json(path, f"stage outputs carry a {PROVENANCE_FILE} (stage, key, upstream)")
    if not isinstance(record, dict) or "stage" not in record:
        raise ValueError(f"{path}: not a posttrain provenance record (no 'stage')")
    return record


def upstream_folder(folder: str | Path, stage: str, key: str) -> Path:
    """Where the output of `stage` with `key` lives, next to `folder` (`<results>/<stage dir>/<key>`)."""
    if stage not in STAGE_DIRS:
        raise ValueError(f"{Path(folder) / PROVENANCE_FILE}: unknown upstream stage {stage!r}")
    return Path(folder).resolve().parent.parent / STAGE_DIRS[stage] / key


def lineage(folder: str | Path) -> list[dict[str, Any]]:
    """Every output `folder` was built from, upstream first, `folder` itself last.

    Each entry: `stage`, `key`, `path`, and `record` (its `posttrain.json`, or None when the folder
    is not next to this one, e.g. after results were moved).
    """
    seen: dict[tuple[str, str], dict[str, Any]] = {}

    def visit(path: Path, stage: str | None, key: str | None) -> None:
        record = read_provenance(path) if (path / PROVENANCE_FILE).is_file() or stage is None else None
        stage = stage or record["stage"]
        key = key or record["key"]
        if (stage, key) in seen:
            return
        for up_stage, up_key in sorted((record or {}).get("upstream", {}).items()):
            visit(upstream_folder(path, up_stage, up_key), up_stage, up_key)
        seen[(stage, key)] = {"stage": stage, "key": key, "path": str(path), "record": record}

    visit(Path(folder), None, None)
    return list(seen.values())
