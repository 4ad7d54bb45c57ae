"""Split files: Arrow IPC stream shards, memory-mapped on reading.

`<data_dir>/<split>/data-00000-of-0000N.arrow`. Written with pyarrow directly, so the bytes depend
only on the data (no random fingerprints): the same rows give byte-identical files. Read back as a
`Split`, a memory-mapped Arrow table that hands out rows as numpy arrays: pyarrow alone, so a
training process does not hold `datasets` and `pandas` (~70 MiB resident, measured) only to index
rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

SHARD_BYTES = 512 * 2**20  # rows are cut into shards of about this size
BOOL_COLUMNS = ("desirable",)  # the unpaired split's labels


def _column(name: str, values: Any) -> pa.Array:
    """[N, S] int array -> fixed-size lists; int sequences -> int32 lists; booleans; strings as they are.

    An empty column is typed by its name: `*ids` and `*labels` columns hold token ids, `BOOL_COLUMNS` booleans.
    """
    if isinstance(values, np.ndarray) and values.ndim == 2:
        return pa.FixedSizeListArray.from_arrays(pa.array(values.astype(np.int32).ravel()), values.shape[1])
    if name in BOOL_COLUMNS:
        return pa.array([bool(v) for v in values], type=pa.bool_())
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


class Split:
    """Rows of one split, read as numpy: token columns as int arrays, text columns as strings.

    `split[rows]` (an index array, list, range or slice) gives a dict of columns: a fixed-length
    token column as one [rows, length] array, a ragged one as a list of arrays. `split[i]` gives
    one row, `split["name"]` one whole column.
    """

    def __init__(self, table: pa.Table):
        self.table = table

    @classmethod
    def from_columns(cls, columns: Mapping[str, Any]) -> Split:
        """A split held in memory, typed as `write_split` would store it."""
        return cls(pa.table({name: _column(name, values) for name, values in columns.items()}))

    def __len__(self) -> int:
        return self.table.num_rows

    @property
    def column_names(self) -> list[str]:
        return self.table.column_names

    def row_length(self, name: str) -> int | None:
        """The fixed length of a token column (packed SFT rows), None for a ragged or text column."""
        kind = self.table.schema.field(name).type
        return kind.list_size if pa.types.is_fixed_size_list(kind) else None

    def select(self, rows: Sequence[int] | np.ndarray) -> Split:
        return Split(self.table.take(pa.array(np.asarray(rows, dtype=np.int64), type=pa.int64())))

    def to_list(self) -> list[dict[str, Any]]:
        """The rows as Python dicts of lists and strings."""
        return self.table.to_pylist()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))

    def __getitem__(self, key: int | str | slice | Sequence[int] | np.ndarray) -> Any:
        if isinstance(key, str):
            return _values(self.table.column(key))
        if isinstance(key, (int, np.integer)):
            return {name: values[0] for name, values in self[[int(key)]].items()}
        rows = np.arange(len(self))[key] if isinstance(key, slice) else key
        table = self.select(rows).table
        return {name: _values(table.column(name)) for name in table.column_names}


def _values(column: pa.ChunkedArray) -> np.ndarray | list[np.ndarray]:
    """A column as numpy: fixed-size lists -> [rows, length], lists -> list of arrays, scalars -> array."""
    array = column.combine_chunks()
    kind = array.type
    if pa.types.is_fixed_size_list(kind):
        return array.flatten().to_numpy().reshape(len(array), kind.list_size)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        if not len(array):
            return []
        offsets = array.offsets.to_numpy()
        return np.split(array.flatten().to_numpy(), offsets[1:-1] - offsets[0])
    return array.to_numpy(zero_copy_only=False)


def load_split(data_dir: str | Path, split: str) -> Split:
    """A split of `data_dir`, its shards memory-mapped (rows are copied only when indexed)."""
    files = sorted((Path(data_dir) / split).glob("data-*.arrow"))
    if not files:
        raise FileNotFoundError(f"{data_dir}: no split {split!r} (expected {split}/data-*.arrow from prepare_data)")
    tables = [pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files]
    return Split(pa.concat_tables(tables))
