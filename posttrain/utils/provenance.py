"""`posttrain.json`: what produced a stage output (config, upstream keys, versions, commit, time)."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
import time
from datetime import datetime, timezone
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from posttrain.stage_config import as_dict
from posttrain.utils.io import PROVENANCE_FILE, atomic_dir, read_json


def git_commit(repo: Path | None = None) -> str | None:
    """The checkout's commit (with `-dirty` when it has local changes), or None outside git."""
    repo = repo or Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}-dirty" if dirty else commit


def write_provenance(out_dir: str | Path, cfg: Mapping[str, Any], stage: str, started: float,
                     metrics: dict[str, Any]) -> dict[str, Any]:
    """Write `out_dir/posttrain.json`; `started` is the `time.time()` at which the stage began.

    `cfg` is recorded whole (a `StageConfig`'s resolved config and run settings, not only what the
    stage declared): what produced the output, for anyone reading it later.
    """
    import torch  # only a stage writes provenance; the dry run reads it torch-free

    cfg = as_dict(cfg)
    now = time.time()
    record = {
        "stage": stage,
        "key": cfg.get("key"),
        "upstream": cfg.get("upstream", {}),
        "seed": cfg.get("seed"),
        "started": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds"),
        "wall_time_s": round(now - started, 3),
        "threads": torch.get_num_threads(),  # intra-op threads change float rounding: the report records them
        "versions": {
            "posttrain": importlib.metadata.version("posttrain"),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "git_commit": git_commit(),
        "metrics": metrics,
        "config": cfg,
    }
    path = Path(out_dir) / PROVENANCE_FILE
    path.write_text(json.dumps(record, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")
    return record


def write_stage_output(out: str | Path, cfg: Mapping[str, Any], stage: str, started: float,
                       write: Callable[[Path], Mapping[str, Any]]) -> dict[str, Any]:
    """A stage's output folder, complete or absent: `write` fills a temporary sibling and returns the summary that
    `posttrain.json` records; the folder takes its name (with its manifest) only then. Returns the summary."""
    with atomic_dir(out) as folder:
        summary = dict(write(folder))
        write_provenance(folder, cfg, stage, started, summary)
    return summary


def read_provenance(folder: str | Path) -> dict[str, Any]:
    """A stage output's `posttrain.json`, or {} when it has none; a corrupt file is an error naming it."""
    path = Path(folder) / PROVENANCE_FILE
    return read_json(path, "not a stage output") if path.is_file() else {}
