"""Atomic output directories: a stage's output appears complete or not at all.

Snakemake treats an existing output as done, so a stage writes into `<out>.tmp-<pid>` and renames
it to `<out>` only after every file is on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PROVENANCE_FILE = "posttrain.json"


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _run_key(directory: Path) -> str | None:
    path = directory / PROVENANCE_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("key")
    except json.JSONDecodeError:
        return None


class OutputExistsError(FileExistsError):
    """The output path already holds a different run's results."""


def refuse_other_run(out: str | Path, key: str | None) -> None:
    """Raise OutputExistsError when `out` is a non-empty directory of another run than `key`.

    A run is known by the `key` in its `posttrain.json`; an output without one counts as another's.
    """
    out = Path(out)
    if out.is_dir() and any(out.iterdir()) and (key is None or _run_key(out) != key):
        raise OutputExistsError(
            f"{out} exists and holds a different run (key {_run_key(out)!r}, this run {key!r}); "
            "remove it or choose another --out"
        )


@contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of `out` to write into; on success fsync it and rename it to `out`.

    On error the temporary directory is removed and `out` is left as it was. An existing `out` is
    replaced only when it is empty or holds the same run (same `key` in `posttrain.json`);
    otherwise this raises `OutputExistsError` rather than destroy another run's output.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        if out.exists():
            refuse_other_run(out, _run_key(tmp))
            old = out.with_name(f"{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_json(path: Path, missing: str) -> Any:
    """The JSON document at `path`; a missing file says `missing` (what to run), a bad one names the file."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing; {missing}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, read a megabyte at a time (checkpoints run to gigabytes)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
