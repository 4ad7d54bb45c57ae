"""Why a stage reruns under a new key when only code moved, and which outputs changed after they were written:
the lines `snakemake -n` prints.

Snakemake only sees that a planned output is missing. When an output of the same stage exists
whose recorded config (`<key>.config.json`) equals the planned one except for its code record,
the user's files it reads and its inputs' keys, the rerun is due to those: the line names the
stage, the old and the new key, the modules whose hash changed (`code`), the user's files whose
content changed (`file`, by config key and path) and the inputs that got a new key (`input`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttrain.stage_config import CONFIG_SUFFIX
from posttrain.utils.manifest import changed
from posttrain.workflow.plan import KEY_VERSION, Job, Plan

SHOWN_MODULES = 6  # a longer list ends with "and N more"
_ASIDE = ("key", "upstream", "code", "files")


def rerun_reasons(plan: Plan) -> list[str]:
    """One line per planned output that is missing while an output differing only in code exists."""
    lines = []
    folders: dict[Path, list[dict[str, Any]]] = {}
    for jobs in plan.jobs.values():
        for job in jobs.values():
            if Path(job.path).exists():
                continue
            folder = Path(job.path).parent
            if folder not in folders:
                folders[folder] = _finished_configs(folder)
            previous = _same_but_code(job, folders[folder])
            if previous is not None:
                lines.append(_reason(job, previous))
    return lines


def changed_outputs(plan: Plan) -> list[str]:
    """One line per planned output that exists and whose files' sizes or times differ from its manifest's: it is
    no longer what its stage wrote (Snakemake still takes it as done; deleting it reruns the stage)."""
    lines = []
    for jobs in plan.jobs.values():
        for job in jobs.values():
            why = changed(Path(job.path)) if Path(job.path).is_dir() else None
            if why:
                lines.append(f"{job.stage}: {why}; the later stages would read it as it is now: delete {job.path} "
                             "to rerun the stage")
    return lines


def _finished_configs(folder: Path) -> list[dict[str, Any]]:
    """The recorded configs of the outputs in `folder`, newest output first."""
    found = []
    for path in folder.glob(f"*{CONFIG_SUFFIX}"):
        output = path.with_name(path.name.removesuffix(CONFIG_SUFFIX))
        if not output.is_dir():
            continue
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue  # not ours to judge: the reason is a hint, the plan stands without it
        if isinstance(cfg, dict):
            found.append((output.stat().st_mtime_ns, cfg))
    return [cfg for _, cfg in sorted(found, key=lambda item: -item[0])]


def _settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if k not in _ASIDE}


def _same_but_code(job: Job, recorded: list[dict[str, Any]]) -> dict[str, Any] | None:
    settings = _settings(job.resolved)
    return next((cfg for cfg in recorded if cfg.get("key") != job.key and _settings(cfg) == settings), None)


def _changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    return sorted(name for name in set(old) | set(new) if old.get(name) != new.get(name))


def _where(record: Mapping[str, Any]) -> str:
    """A changed file's path (relative to the working directory when under it), module or hub id."""
    if "path" in record:
        path = Path(record["path"])
        return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)
    return str(record.get("module") or record.get("hub") or "removed")


def _reason(job: Job, previous: Mapping[str, Any]) -> str:
    old_code = previous.get("code")
    modules = _changed(old_code["modules"] if isinstance(old_code, dict) else {}, job.resolved["code"]["modules"])
    inputs = _changed(previous.get("upstream") or {}, job.resolved["upstream"])
    files = job.resolved.get("files", {})
    changed_files = _changed(previous.get("files") or {}, files)
    parts = []
    if modules:
        shown = ", ".join(modules[:SHOWN_MODULES])
        more = len(modules) - SHOWN_MODULES
        parts.append(f"code: {shown}" + (f" and {more} more" if more > 0 else ""))
    if changed_files:
        parts.append("file: " + ", ".join(f"{name} ({_where(files.get(name, {}))})" for name in changed_files))
    if inputs:
        parts.append(f"input: new key of {', '.join(inputs)}")
    if not parts:
        parts.append(f"key recipe (KEY_VERSION {KEY_VERSION})")
    return f"rerun reason: {job.stage} {job.key} (was {previous['key']}): {'; '.join(parts)}"
