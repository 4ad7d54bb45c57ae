"""Deterministic, resumable, data-parallel batch iteration over the splits prepare_data writes.

`batch_size` is the global batch: each epoch is a permutation seeded by (seed, epoch), cut into
global batches, and rank r of `world_size` takes the r-th contiguous slice of each. The state is
(epoch, index of the next global batch), so a run restored with `load_state_dict` yields exactly
the batches it would have yielded, on every rank.

Batch keys:
- `sft_batches` (splits `sft`, `sft_eval`): `input_ids`, `labels`, `document_ids`, `position_ids`
  ([r, L] int64, r <= b: the rows' trained spans repacked into fewer rows when they fit, see
  `repack_trained_spans`; L <= max_seq_len: cut after the batch's last trained token, see
  `trim_to_trained`; position ids restart at each document), `index` ([b] dataset row indices).
- `preference_batches`: `chosen_input_ids`, `chosen_labels`, `rejected_input_ids`,
  `rejected_labels` ([b, L] int64, right-padded to the longest of both sides in the batch, labels
  -100 on the prompt and padding), `index`.
- `prompt_batches` (splits `prompts`, `eval`): `prompt_ids` (list of int lists, ragged), `answers`,
  `tasks` (lists of str), `examples` (list of dicts for the verifiers), `index`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain.data.chat import IGNORE_INDEX
from posttrain.data.packing import repack_trained_spans
from posttrain.data.store import Split, load_split
from posttrain.models import document_positions
from posttrain.tokenizer import Tokenizer

Batch = dict[str, Any]


class Batches:
    """Batches of one split for one data-parallel rank; iterate with `next()`.

    `loop=True` (training) runs epoch after epoch and drops each epoch's incomplete last batch, so
    every batch has the same size; `loop=False` (evaluation) makes one pass including it (a rank
    may then get fewer rows, possibly none).
    """

    def __init__(
        self,
        dataset: Split,
        batch_size: int,
        collate: Callable[[dict[str, Any], np.ndarray], Batch],
        *,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        loop: bool = True,
    ):
        if batch_size % world_size:
            raise ValueError(f"global batch size {batch_size} is not divisible by the data-parallel size {world_size}")
        if loop and len(dataset) < batch_size:
            raise ValueError(f"split has {len(dataset)} rows, fewer than one global batch of {batch_size}")
        self.dataset = dataset
        self.batch_size, self.collate = batch_size, collate
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.shuffle, self.loop = shuffle, loop
        self.epoch, self.index = 0, 0
        self._order_cache: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))

    def __len__(self) -> int:
        """Global batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.loop else -(-n // self.batch_size)

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache[0] != epoch:
            n = len(self.dataset)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self.index >= len(self):
            if not self.loop:
                raise StopIteration
            self.epoch, self.index = self.epoch + 1, 0
        start = self.index * self.batch_size
        rows = self._order(self.epoch)[start : start + self.batch_size]
        mine = np.array_split(rows, self.world_size)[self.rank]
        self.index += 1
        return self.collate(self.dataset[mine], mine)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def _long(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))


# Trimmed lengths are multiples of this by default: few distinct shapes for torch.compile, and
# divisible by any power-of-two tensor-parallel degree up to it (sequence parallelism splits the
# sequence). Eager runs use EAGER_MULTIPLE (`length_multiple`).
TRIM_MULTIPLE = 64
EAGER_MULTIPLE = 8  # aligned for tensor cores, and few positions computed past the last trained token


def length_multiple(compiled: bool, tp: int = 1) -> int:
    """What a run's batch lengths are multiples of: `TRIM_MULTIPLE` under torch.compile (each new
    shape recompiles), `EAGER_MULTIPLE` otherwise; always divisible by the tensor-parallel degree."""
    return math.lcm(TRIM_MULTIPLE if compiled else EAGER_MULTIPLE, tp)


def trim_to_trained(batch: Batch, multiple: int = TRIM_MULTIPLE) -> Batch:
    """The batch's [rows, L] tensors cut after its last trained token (rounded up to `multiple`).

    Attention is causal, so positions after a row's last trained token change no loss term: a
    padded batch of short documents then costs what its longest document costs, not the row length.
    """
    full = batch["input_ids"].shape[1]
    trained = (batch["labels"] != IGNORE_INDEX).any(0).nonzero()
    length = int(trained[-1]) + 1 if len(trained) else 1
    length = min(full, -(-length // multiple) * multiple)
    return {k: v[:, :length] if isinstance(v, torch.Tensor) and v.dim() == 2 else v for k, v in batch.items()}


def sft_rows_batch(input_ids: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor,
                   repack: bool = True, multiple: int = TRIM_MULTIPLE) -> Batch:
    """A training batch from [rows, L] SFT rows: padding-free (trained spans repacked; `repack=False`
    keeps the rows as stored, for comparison), trimmed to a multiple of `multiple`, with
    per-document position ids."""
    rows = (input_ids, labels, document_ids)
    batch = trim_to_trained(dict(zip(("input_ids", "labels", "document_ids"),
                                     repack_trained_spans(*rows, multiple=multiple) if repack else rows)), multiple)
    batch["position_ids"] = document_positions(batch["document_ids"])
    return batch


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch's tensors on `device` (other values as they are)."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def at_least_one_row(batch: Batch) -> Batch:
    """An SFT evaluation batch every rank can run: the last batch of a split may leave a rank no rows,
    but every rank must take part in each sharded forward. The stand-in row has no loss tokens."""
    rows, seq_len = batch["input_ids"].shape
    if rows:
        return batch
    return {
        "input_ids": torch.zeros(1, seq_len, dtype=torch.long),
        "labels": torch.full((1, seq_len), IGNORE_INDEX, dtype=torch.long),
        "document_ids": torch.zeros(1, seq_len, dtype=torch.long),
        "position_ids": torch.arange(seq_len)[None],
    }


def _sft_collate(seq_len: int, multiple: int) -> Callable[[dict[str, Any], np.ndarray], Batch]:
    def collate(cols: dict[str, Any], index: np.ndarray) -> Batch:
        rows = (_long(cols[k]).view(len(index), seq_len) for k in ("input_ids", "labels", "document_ids"))
        batch = sft_rows_batch(*rows, multiple=multiple)
        batch["index"] = _long(index)
        return batch

    return collate


def _pad(seqs: list[np.ndarray], length: int, value: int) -> torch.Tensor:
    out = np.full((len(seqs), length), value, dtype=np.int64)
    for i, seq in enumerate(seqs):
        out[i, : len(seq)] = seq
    return torch.from_numpy(out)


def preference_collate(pad_id: int) -> Callable[[dict[str, Any], np.ndarray], Batch]:
    """Collate for preference rows (also pairs built outside prepare_data: DPO's held-out and on-policy pairs,
    and the unpaired split's rows, whose `desirable` labels it carries)."""

    def collate(cols: dict[str, Any], index: np.ndarray) -> Batch:
        sides = ("chosen", "rejected")
        length = max((len(s) for side in sides for s in cols[f"{side}_input_ids"]), default=0)
        batch = {"index": _long(index)}
        for side in sides:
            batch[f"{side}_input_ids"] = _pad(list(cols[f"{side}_input_ids"]), length, pad_id)
            batch[f"{side}_labels"] = _pad(list(cols[f"{side}_labels"]), length, IGNORE_INDEX)
        if "desirable" in cols:  # the unpaired split (KTO): each row's label
            batch["desirable"] = torch.as_tensor(np.asarray(cols["desirable"], dtype=bool))
        return batch

    return collate


def prompt_collate(cols: dict[str, Any], index: np.ndarray) -> Batch:
    """Prompt rows (`prompt_ids`, `answer`, `task`, `example` columns) as a `prompt_batches` batch."""
    return {
        "prompt_ids": [ids.tolist() for ids in cols["prompt_ids"]],
        "answers": [str(a) for a in cols["answer"]],
        "tasks": [str(t) for t in cols["task"]],
        "examples": [json.loads(e) for e in cols["example"]],
        "index": _long(index),
    }


def sft_batches(
    data_dir: str | Path, batch_size: int, *, seed: int, split: str = "sft", rank: int = 0, world_size: int = 1,
    shuffle: bool = True, loop: bool = True, multiple: int = TRIM_MULTIPLE,
) -> Batches:
    """Packed (or padded) SFT rows: `input_ids`, `labels`, `document_ids`, `position_ids`, `index`;
    batch lengths are multiples of `multiple` (see `length_multiple`)."""
    dataset = load_split(data_dir, split)
    seq_len = dataset.row_length("input_ids")
    if seq_len is None:
        raise ValueError(f"{data_dir}/{split}: input_ids are not fixed-length rows; rerun prepare_data")
    return Batches(dataset, batch_size, _sft_collate(seq_len, multiple), seed=seed, rank=rank,
                   world_size=world_size, shuffle=shuffle, loop=loop)


def preference_batches(
    data_dir: str | Path, batch_size: int, *, seed: int, split: str = "preference", rank: int = 0, world_size: int = 1,
    shuffle: bool = True, loop: bool = True,
) -> Batches:
    """Preference pairs: `{chosen,rejected}_{input_ids,labels}` padded to one length, `index`."""
    pad_id = Tokenizer(Path(data_dir) / "tokenizer").pad_id
    return Batches(load_split(data_dir, split), batch_size, preference_collate(pad_id), seed=seed, rank=rank,
                   world_size=world_size, shuffle=shuffle, loop=loop)


def prompt_batches(
    data_dir: str | Path, batch_size: int, *, seed: int, split: str = "prompts", rank: int = 0, world_size: int = 1,
    shuffle: bool = True, loop: bool = True,
) -> Batches:
    """Prompts for generation: ragged `prompt_ids`, `answers`, `tasks`, `examples`, `index`."""
    return Batches(load_split(data_dir, split), batch_size, prompt_collate, seed=seed, rank=rank,
                   world_size=world_size, shuffle=shuffle, loop=loop)


def eval_split_rows(data_dir: str | Path, n: int | None = None) -> Batch:
    """The first `n` rows (None: all) of the `eval` split, in data order, as one `prompt_batches` batch: the one
    reader of the held-out prompts every stage measures on (greedy accuracy, pass@k, preference pairs)."""
    split = load_split(data_dir, "eval")
    index = np.arange(len(split) if n is None else min(n, len(split)))
    return prompt_collate(split[index], index)
