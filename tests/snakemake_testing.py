"""Snakemake in tests: a copy of the repository to run it in, and reading its console output."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def copy_repo(root: Path, names: tuple[str, ...]) -> None:
    """The repository's files and folders `names` under `root` (bytecode caches left out), for a workflow run there."""
    for name in names:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, root / name)


def job_counts(output: str) -> Counter:
    """Jobs per rule from the "Job stats" table Snakemake prints before running (or dry-running) a DAG;
    empty when there is nothing to do."""
    if "Nothing to be done" in output or "Job stats:" not in output:
        return Counter()
    counts = Counter()
    for line in output.split("Job stats:")[1].splitlines()[3:]:
        words = line.split()
        if len(words) != 2 or words[0] == "total":
            break
        counts[words[0]] = int(words[1])
    return counts
