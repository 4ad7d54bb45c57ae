"""Resumable training state, written with `torch.distributed.checkpoint` next to the stage output.

Layout of `<out>.resume/` (outside the declared output, so Snakemake never deletes it on failure):

    metrics.jsonl            live metrics, copied into the final output
    step-00000100/           the last complete checkpoint: DCP shards of the trainable parameters
                             and optimizer state, plus `rank-<r>.json` per rank (step, data
                             position, scheduler, python/torch RNG), plus any files the data
                             source writes beside them (async GRPO: the weights of the policy
                             versions sampling its work in flight)
    best-00000060/           with `keep: best`: the trainable weights of the best evaluation so far
                             (the one the last checkpoint names, and a newer best written since)

A checkpoint is written into `step-N.tmp/` and renamed to `step-N/` once every rank is done, so
a kill during saving leaves the previous checkpoint usable. Each carries a manifest of its files'
digests (`posttrain.utils.manifest`, hashed by every rank in parallel once the files are written),
and the two newest are kept: a resume checks the newest against its manifest and, when a file was
flipped, truncated or lost (a bad disk, a partial copy), falls back to the one before, saying so in
one line; with none intact it stops naming the file. A full disk while saving stops the stage with
one line naming the folder and the free space, the unfinished folder removed.
Frozen parameters (LoRA / QLoRA bases) are rebuilt by setup, not saved.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from posttrain.model_files.hf import nonfinite_tensor
from posttrain.optim import load_optimizer_state_dict, optimizer_state_dict
from posttrain.utils.io import DiskFullError, no_space_left, refuse_other_run
from posttrain.utils.manifest import damage, file_records, folder_files, write_manifest

_STEP_DIR = re.compile(r"^step-(\d{8})$")
_BEST_DIR = re.compile(r"^best-(\d{8})$")
_OPTIONS = StateDictOptions(ignore_frozen_params=True)
# Loading a state without the frozen parameters: they are reported missing, and checked below.
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)
KEEP = 2  # checkpoints kept: the newest, and the one to fall back to if the newest is found damaged


class ResumeError(RuntimeError):
    """Resume state that does not fit this run; the message names the directory."""


def resume_dir(out: str | os.PathLike) -> Path:
    """`<out>.resume`: the sibling directory holding a stage's resume state."""
    out = Path(out)
    return out.with_name(out.name + ".resume")


@dataclass
class ResumePoint:
    """What a loaded checkpoint hands back to the training loop."""

    step: int
    data_state: dict[str, Any]
    path: Path


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _gathered(value: Any) -> list[Any]:
    """`value` of every rank, in rank order."""
    if dist.is_available() and dist.is_initialized():
        values: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
        return values
    return [value]


def _from_rank0(value: Any) -> Any:
    if dist.is_available() and dist.is_initialized():
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _digest(folder: Path) -> None:
    """`folder`'s manifest: every rank hashes a share of its files, rank 0 writes them down."""
    rank, world = _rank_world()
    names = folder_files(folder)
    records = {k: v for part in _gathered(file_records(folder, names[rank::world])) for k, v in part.items()}
    if rank == 0:
        write_manifest(folder, records)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": _jsonable(random.getstate()), "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuples(state["python"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _jsonable(x: Any) -> Any:
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process save/load that it is single-process: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def _write_json(path: Path, record: dict[str, Any]) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())


class Checkpointer:
    """Periodic resumable checkpoints of one stage run; every rank calls every method.

    `key` is the stage key of the run: state left by a different configuration is refused
    rather than silently mixed in, and so is an `out` that already holds another run's results
    (at the start, not after training, when the final output would have to replace it).
    """

    def __init__(self, out: str | os.PathLike, every: int, key: str | None = None):
        refuse_other_run(out, key)
        self.root = resume_dir(out)
        self.every = int(every)
        self.key = key
        self.rank, self.world_size = _rank_world()  # the directory appears with the first save

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    def due(self, step: int, last_step: int) -> bool:
        """Whether to checkpoint after `step` (never after the last: the final output follows)."""
        return self.every > 0 and step % self.every == 0 and step < last_step

    def latest(self) -> Path | None:
        """The newest complete checkpoint directory, if any (not yet checked against its manifest)."""
        steps = self._steps()
        return steps[-1] if steps else None

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        data_state: dict[str, Any],
        extra: Mapping[str, tuple[nn.Module, torch.optim.Optimizer]] | None = None,
        write_files: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write the state after `step` atomically and drop older checkpoints; returns the directory.

        `extra`: further (model, optimizer) pairs trained beside the main one (PPO's critic), by name;
        `write_files`: called on every rank with the checkpoint directory being written, for state
        that is neither tensors of a module nor JSON (it lands in the checkpoint atomically with the rest).
        """
        final = self.root / f"step-{step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()

        def write_state() -> None:
            state = _states(model, optimizer, extra)
            with _single_process_quiet():
                dcp.save(state, checkpoint_id=tmp, no_dist=self.world_size == 1)
            if write_files is not None:
                write_files(tmp)
            record = {
                "step": step,
                "key": self.key,
                "world_size": self.world_size,
                "data": data_state,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "rng": _rng_state(),
            }
            _write_json(tmp / f"rank-{self.rank}.json", record)

        doing = f"writing the checkpoint of step {step}; {self._previous()}"
        self._unless_disk_full(write_state, tmp, doing)
        self._unless_disk_full(lambda: _digest(tmp), tmp, doing)
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            fd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            for old in self._steps()[:-KEEP]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    def _unless_disk_full(self, write: Callable[[], None], tmp: Path, doing: str) -> None:
        """`write()` on every rank; a full disk on any rank stops them all alike, `tmp` removed (nothing half-written
        is left, under any name), with one line naming it and the free space."""
        failed = None
        try:
            write()
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            if not no_space_left(err):
                raise
            failed = DiskFullError.at(tmp, doing)
        failed = next((f for f in _gathered(failed) if f is not None), None)
        if failed is not None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise failed

    def _steps(self) -> list[Path]:
        """The complete checkpoint folders, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))

    def _previous(self) -> str:
        latest = self.latest()
        return f"the previous checkpoint {latest} is intact" if latest else "no checkpoint was written before it"

    def kept_steps(self) -> list[int]:
        """The steps of the checkpoints kept (a resume may fall back to any)."""
        return [int(p.name.split("-")[1]) for p in self._steps()]

    def _intact(self) -> Path | None:
        """The newest checkpoint whose files match its manifest, each damaged newer one said in a line (rank 0
        checks, every rank takes its answer); raises when some exist and none is intact."""
        found: Path | str | None = None
        if self.rank == 0:
            steps = self._steps()
            problems = []
            for path in reversed(steps):
                why = damage(path)
                if why is None:
                    found = path
                    break
                problems.append(why)
                print(f"checkpoint {path.name} is damaged: {why}; "
                      f"{'falling back to the one before it' if path != steps[0] else 'no older one is kept'}",
                      flush=True)
            if steps and found is None:
                found = f"{problems[0]}; no intact checkpoint to resume from: delete {self.root} to start over"
        found = _from_rank0(found)
        if isinstance(found, str):
            raise ResumeError(found)
        return found

    def load(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        extra: Mapping[str, tuple[nn.Module, torch.optim.Optimizer]] | None = None,
    ) -> ResumePoint | None:
        """Restore the newest checkpoint into model, optimizers, scheduler, RNGs (and `extra`, as saved); None when there is none.

        With none, the run starts over: live metrics that a killed run logged before its first
        checkpoint are dropped, or the new run's records would follow them.
        """
        path = self._intact()
        if path is None:
            if self.rank == 0:
                self.metrics_path.unlink(missing_ok=True)
            return None
        record_path = path / f"rank-{self.rank}.json"
        if not record_path.exists():
            raise ResumeError(
                f"{path}: resume state has no {record_path.name}; it was written by a run with a different number "
                f"of processes than this one ({self.world_size}). Rerun with the same count or delete {self.root}"
            )
        record = json.loads(record_path.read_text())
        if record["world_size"] != self.world_size:
            raise ResumeError(
                f"{path}: resume state was written by {record['world_size']} processes, this run has "
                f"{self.world_size}. Rerun with the same count or delete {self.root}"
            )
        if record.get("key") != self.key:
            raise ResumeError(
                f"{path}: resume state belongs to stage key {record.get('key')!r}, not this run's {self.key!r}; "
                f"delete {self.root}"
            )
        state = _states(model, optimizer, extra)
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=path, no_dist=self.world_size == 1)
        bad = [nonfinite_tensor(state[part]) for part in state if part.endswith("model")]
        bad = next((b for rank in _gathered(bad) for b in rank if b), None)
        if bad:
            raise ResumeError(f"{path}: tensor {bad} holds NaN or inf values (written so, its digests match): resuming "
                              f"would train on them; delete {path} to resume from the one before, or {self.root}")
        for name, (module, optim) in {"": (model, optimizer), **{f"{k}/": v for k, v in (extra or {}).items()}}.items():
            result = set_model_state_dict(module, state[f"{name}model"], options=_LOAD_OPTIONS)
            frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
            wrong = sorted(set(result.missing_keys) - frozen) + sorted(result.unexpected_keys)
            if wrong:
                raise ResumeError(f"{path}: checkpoint does not match the {name.rstrip('/') or 'model'} "
                                  f"(first mismatched tensor {wrong[0]!r})")
            load_optimizer_state_dict(module, optim, state[f"{name}optim"])
        if scheduler is not None:
            scheduler.load_state_dict(record["scheduler"])
        _set_rng_state(record["rng"])
        return ResumePoint(step=int(record["step"]), data_state=record["data"], path=path)

    def _best_dir(self, step: int) -> Path:
        return self.root / f"best-{step:08d}"

    def save_best(self, step: int, model: nn.Module) -> None:
        """The trainable weights after `step` into `best-<step>/` (atomically, like a checkpoint); older bests stay
        until a checkpoint that names this one is complete (`prune_best`)."""
        final = self._best_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        with _single_process_quiet():
            dcp.save({"model": get_model_state_dict(model, options=_OPTIONS)}, checkpoint_id=tmp,
                     no_dist=self.world_size == 1)
        _barrier()
        _digest(tmp)
        _barrier()
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        _barrier()

    def load_best(self, step: int | None, model: nn.Module) -> None:
        """Load `best-<step>/` into `model` (its trainable weights)."""
        path = self._best_dir(step) if step is not None else None
        if path is None or not path.is_dir():
            raise ResumeError(f"{path or self.root}: the best evaluation's weights are missing; delete {self.root} "
                              "and rerun the stage")
        why = _from_rank0(damage(path) if self.rank == 0 else None)
        if why:
            raise ResumeError(f"{why}; the best evaluation's weights are damaged: delete {self.root} and rerun the stage")
        state = {"model": get_model_state_dict(model, options=_OPTIONS)}
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=path, no_dist=self.world_size == 1)
        set_model_state_dict(model, state["model"], options=_LOAD_OPTIONS)

    def prune_best(self, keep: int | None) -> None:
        """Remove every `best-*/` but `best-<keep>/` (the one the current state names) and those the kept
        checkpoints name (a resume may fall back to one of them)."""
        _barrier()
        if self.rank == 0 and self.root.is_dir():
            named = {keep} | {self._named_best(path) for path in self._steps()}
            wanted = {f"best-{step:08d}" for step in named if step is not None}
            for path in self.root.iterdir():
                match = _BEST_DIR.match(path.name) or (path.name.endswith(".tmp") and path.name.startswith("best-"))
                if match and path.name not in wanted:
                    shutil.rmtree(path, ignore_errors=True)
        _barrier()

    @staticmethod
    def _named_best(checkpoint: Path) -> int | None:
        """The best evaluation's step a checkpoint's state names (None: none, or unreadable)."""
        try:
            return json.loads((checkpoint / "rank-0.json").read_text())["data"]["selection"]["best_step"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def remove(self) -> None:
        """Delete the resume state once the final output is complete."""
        remove_resume_state(self.root)


def _states(model: nn.Module, optimizer: torch.optim.Optimizer,
            extra: Mapping[str, tuple[nn.Module, torch.optim.Optimizer]] | None) -> dict[str, Any]:
    """The DCP state of the main (model, optimizer) and of each extra pair under `<name>/`."""
    state = {"model": get_model_state_dict(model, options=_OPTIONS), "optim": optimizer_state_dict(model, optimizer)}
    for name, (module, optim) in (extra or {}).items():
        state[f"{name}/model"] = get_model_state_dict(module, options=_OPTIONS)
        state[f"{name}/optim"] = optimizer_state_dict(module, optim)
    return state


def remove_resume_state(root: Path) -> None:
    """Delete a stage's resume directory `root` once its final output is complete (every rank calls; rank 0 deletes)."""
    _barrier()
    if _rank_world()[0] == 0:
        shutil.rmtree(root, ignore_errors=True)
