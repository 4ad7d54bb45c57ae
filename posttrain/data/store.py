"""Split files: Arrow IPC stream shards that `datasets.Dataset.from_file` memory-maps.

`<data_dir>/<split>/data-00000-of-0000N.arrow`. Written with pyarrow directly, so the bytes depend
only on the data (no random fingerprints): the same rows give byte-identical files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa

SHARD_BYTES = 512 * 2**20  # rows are cut into shards of about this size


def _column(name: str, values: Any) -> pa.Array:
    """[N, S] int array -> fixed-size lists; int sequences -> int32 lists; strings as they are.

    An empty column is typed by its name: `*ids` and `*labels` columns hold token ids.
    """
    if isinstance(values, np.ndarray) and values.ndim == 2:
        return pa.FixedSizeListArray.from_arrays(pa.array(values.astype(np.int32).ravel()), values.shape[1])
    token_column = len(values) > 0 and not isinstance(values[0], str) or name.endswith(("ids", "labels"))
    if not token_column:
        return pa.array(values, type=pa.string())
    lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = np.concatenate([np.asarray(v, dtype=np.int32) for v in values]) if len(values) else np.empty(0, np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=pa.int32()))


def write_split(data_dir: str | Path, split: str, columns: dict[str, Any]) -> Path:
    """Write one split's columns (equal numbers of rows) as Arrow stream shards under `data_dir/split`."""
    table = pa.table({name: _column(name, values) for name, values in columns.items()})
    folder = Path(data_dir) / split
    folder.mkdir(parents=True, exist_ok=True)
    rows_per_shard = max(1, SHARD_BYTES * max(table.num_rows, 1) // max(table.nbytes, 1))
    n_shards = max(1, -(-table.num_rows // rows_per_shard))
    for s in range(n_shards):
        part = table.slice(s * rows_per_shard, rows_per_shard)
        with pa.OSFile(str(folder / f"data-{s:05d}-of-{n_shards:05d}.arrow"), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(part)
    return folder


def load_split(data_dir: str | Path, split: str) -> datasets.Dataset:
    """A split as a memory-mapped `datasets.Dataset`."""
    files = sorted((Path(data_dir) / split).glob("data-*.arrow"))
    if not files:
        raise FileNotFoundError(f"{data_dir}: no split {split!r} (expected {split}/data-*.arrow from prepare_data)")
    parts: Sequence[datasets.Dataset] = [datasets.Dataset.from_file(str(f)) for f in files]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(list(parts))
