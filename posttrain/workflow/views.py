"""The small files the workflow writes itself: resolved configs, run settings and the per-variant views.

The resolved configs and run settings are written while Snakemake parses the workflow
(`write_plan_files`), not by jobs: a stage's config is a pure function of its key, so the file is
written once and never changes, and the report's changes exactly when the set of variants does.
Writing only what differs keeps modification times, so a no-op run stays a no-op. The run
settings (`<key>.run.json`) are no rule input: rewriting them reruns nothing.

    python -m posttrain.workflow.views --manifest JSON --out results/variants/<name>
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"


def _json_text(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"


def write_json(path: str | Path, value: Any) -> bool:
    """Write `value` as indented, key-sorted JSON, atomically, unless the file already holds it.

    Returns whether the file was written.
    """
    path = Path(path)
    text = _json_text(value)
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return True


def write_plan_files(results: str, files: Mapping[str, Mapping[str, Any]]) -> int:
    """`<results>/<name>` for every planned file (`Plan.files()`); returns how many were (re)written."""
    return sum(write_json(f"{results}/{name}", content) for name, content in files.items())


def write_variant_view(out: str | Path, manifest: Mapping[str, Any]) -> None:
    """`out/manifest.json` plus a relative symlink per output: `sft`, ..., `eval-sft`, ..., `export`."""
    out = Path(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    links = {stage: ref["path"] for stage, ref in manifest["stages"].items()}
    links.update({f"eval-{stage}": ref["path"] for stage, ref in manifest["eval"].items()})
    links["export"] = manifest["export"]["path"]
    for name, target in links.items():
        os.symlink(os.path.relpath(target, out), tmp / name)
    write_json(tmp / MANIFEST, manifest)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a variant's view: manifest.json and a link per output.")
    parser.add_argument("--manifest", required=True, help="the variant's manifest as JSON text")
    parser.add_argument("--out", required=True, help="results/variants/<name>")
    args = parser.parse_args(argv)
    write_variant_view(args.out, json.loads(args.manifest))


if __name__ == "__main__":
    main()
