"""Digests of a folder's files, written with the folder and checked before it is trusted.

A checkpoint or a stage output is written whole into a temporary folder and renamed; `manifest.json` beside its
files records each one's BLAKE3 digest (the `blake3` binding of the reference Rust crate: cryptographic, and
several times sha256's speed, over every core), size and modification time. Reading it back, `damage` re-hashes every file: a
flipped bit, a truncated or partly copied file, a file missing or added shows as one line naming the file. `changed`
compares sizes and times alone, cheap enough for every dry run: a file replaced or edited after it was written.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import blake3


MANIFEST = "manifest.json"
NOT_WRITTEN = {MANIFEST, ".snakemake_timestamp"}  # the manifest itself, and what Snakemake adds to a finished folder


def file_digest(path: Path) -> str:
    """The hex BLAKE3 digest of a file's bytes, mapped into memory and hashed on every core."""
    digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if Path(path).stat().st_size:  # an empty file cannot be mapped
        digest.update_mmap(str(path))
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, read a megabyte at a time (checkpoints run to gigabytes)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class DamagedFileError(ValueError):
    """A file of a stage's output is not what the stage wrote; the message names it."""


def folder_files(folder: Path) -> list[str]:
    """Every file under `folder` its writer wrote (not the manifest, nor Snakemake's marker), as sorted relative paths."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.relative_to(folder).as_posix() not in NOT_WRITTEN)


def file_records(folder: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """{name: blake3, size, mtime_ns} of the files `names` under `folder` (processes may split a folder's files and
    merge their records)."""
    records = {}
    for name in names:
        path = folder / name
        stat = path.stat()
        records[name] = {"blake3": file_digest(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return records


def write_manifest(folder: Path, records: dict[str, dict[str, Any]] | None = None) -> None:
    """`folder`'s manifest (`records`, or every file's); written to a temporary name, synced, then renamed."""
    records = file_records(folder, folder_files(folder)) if records is None else records
    tmp = folder / f"{MANIFEST}.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        json.dump({"files": records}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(folder / MANIFEST)


def _read(folder: Path) -> dict[str, dict[str, Any]] | str:
    path = folder / MANIFEST
    try:
        return json.loads(path.read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        return f"{path}: missing (written before its files were digested, or cut short)"
    except (ValueError, KeyError, TypeError) as err:
        return f"{path}: damaged ({type(err).__name__})"


def damage(folder: Path) -> str | None:
    """One line naming the first file of `folder` that is not as its manifest recorded it; None: all intact."""
    records = _read(folder)
    if isinstance(records, str):
        return records
    present = set(folder_files(folder))
    for name, record in sorted(records.items()):
        path = folder / name
        if name not in present:
            return f"{path}: missing"
        size = path.stat().st_size
        if size != record["size"]:
            return f"{path}: {size} bytes where {record['size']} were written (truncated or partly copied)"
        if file_digest(path) != record.get("blake3"):
            return f"{path}: its bytes differ from those written (digest mismatch: damaged on disk or in a copy)"
    extra = sorted(present - set(records))
    return f"{folder / extra[0]}: not among the files written" if extra else None


def changed(folder: Path, names: Sequence[str] | None = None) -> str | None:
    """One line naming the first file (of `names`, or all) whose size or time differs from its manifest's: edited,
    replaced or truncated since it was written. None: unchanged, or a folder without a manifest."""
    records = _read(folder)
    if isinstance(records, str):
        return None
    for name in names if names is not None else sorted(records):
        path, record = folder / name, records.get(name)
        if record is None:
            continue
        try:
            stat = path.stat()
        except FileNotFoundError:
            return f"{path}: removed after it was written"
        if (stat.st_size, stat.st_mtime_ns) != (record["size"], record["mtime_ns"]):
            return f"{path}: changed after it was written ({record['size']} -> {stat.st_size} bytes)"
    return None


def require_intact(folder: Path, what: str) -> None:
    """Raise `DamagedFileError` naming the first damaged file of `folder` (`what` it is, for the message); a folder
    without a manifest (a user's own, or written before outputs had one) is taken as it is."""
    if not (folder / MANIFEST).is_file():
        return
    why = damage(folder)
    if why:
        raise DamagedFileError(f"{why}; {what} {folder} is not what its stage wrote: delete it and rerun that stage")
