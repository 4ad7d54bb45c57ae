"""Atomic output directories: a stage's output appears complete or not at all.

Snakemake treats an existing output as done, so a stage writes into `<out>.tmp-<pid>` and renames
it to `<out>` only after every file is on disk.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from posttrain.utils.manifest import file_sha256, write_manifest

__all__ = ["DiskFullError", "OutputExistsError", "atomic_dir", "file_sha256", "no_space_left", "read_json",
           "refuse_other_run"]

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


class DiskFullError(OSError):
    """The disk filled while a stage wrote: the message names the folder, the free space and what is intact."""

    @classmethod
    def at(cls, path: Path, doing: str) -> DiskFullError:
        usage = shutil.disk_usage(next((p for p in (path, *path.parents) if p.exists()), Path("/")))
        return cls(errno.ENOSPC, f"{path}: no space left on device ({usage.free / 2**20:.1f} MiB free of "
                                 f"{usage.total / 2**20:.1f} MiB) while {doing}")

    def __str__(self) -> str:
        return str(self.strerror)


def no_space_left(err: BaseException | None) -> bool:
    """Whether `err` (or what caused it, or a failure it gathers from other ranks) is a full disk."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        if not isinstance(err, OSError) and "(os error 28)" in str(err):  # safetensors' Rust writer: its errno in text
            return True
        failures = getattr(err, "failures", None)  # torch.distributed.checkpoint's: {rank: (exception, trace)}
        if isinstance(failures, dict) and any(no_space_left(f[0] if isinstance(f, tuple) else f)
                                              for f in failures.values()):
            return True
        err = err.__cause__ or err.__context__
    return False


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
        write_manifest(tmp)  # what a later stage, or a dry run, checks it against
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
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if no_space_left(err) and not isinstance(err, DiskFullError):
            raise DiskFullError.at(tmp, f"writing the output {out}; nothing is left under its name") from None
        raise


def read_json(path: Path, missing: str) -> Any:
    """The JSON document at `path`; a missing file says `missing` (what to run), a bad one names the file."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing; {missing}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
