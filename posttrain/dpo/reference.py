"""The DPO reference model's log-probs: precomputed once and cached, or computed on the fly.

- `precompute`: before training, one no-grad pass scores every training pair with the starting
  (SFT) weights; the loop then looks each batch's rows up by index (`PrecomputedReference`), so
  no reference model sits in memory while training. The values are cached in
  `<out>.resume/reference_logps.safetensors` (next to the stage output, removed with the resume
  state after success), so a resumed run does not score the split again.
- `online`: the reference runs every step under no_grad (`OnlineReference`): a frozen copy of the
  model for full fine-tuning or, with LoRA/QLoRA, the policy itself with its adapters disabled.

The cache's metadata holds a fingerprint of what its values depend on (the stage key, the model's
weight files, the pair data's files, the row counts); a file with another fingerprint is ignored
and recomputed, never mixed in.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from posttrain.model_files import CheckpointError, resolve_model_source
from posttrain.data.loader import Batches
from posttrain.data.store import Split
from posttrain.dpo.logprobs import pair_logprobs, reshard, score_pairs
from posttrain.losses.head import OutputHead
from posttrain.models import Transformer, is_preset
from posttrain.models.lora import disable_adapters
from posttrain.parallel import barrier
from posttrain.training.checkpointer import resume_dir
from posttrain.utils.manifest import file_digest

if TYPE_CHECKING:
    from posttrain.training.harness import StageRun

CACHE_NAME = "reference_logps.safetensors"
_FINGERPRINT_KEY = "fingerprint"


def reference_cache_path(out: str | os.PathLike) -> Path:
    """Where the precomputed reference log-probs of the stage writing `out` are cached."""
    return resume_dir(out) / CACHE_NAME


def file_stats(paths: Iterable[Path]) -> list[tuple[str, int, int]]:
    """(path, size, modification time in ns) of each file: changes whenever a file is rewritten."""
    stats = []
    for path in sorted(Path(p) for p in paths):
        st = path.stat()
        stats.append((str(path.resolve()), st.st_size, st.st_mtime_ns))
    return stats


def model_files(source: str) -> list[tuple[str, int, int]] | str:
    """What identifies a model source's weights: its folder's config and safetensors files, or a preset's name."""
    if is_preset(source):
        return f"preset:{source}"
    folder = resolve_model_source(source)
    return file_stats([folder / "config.json", *folder.glob("*.safetensors"), *folder.glob("*.safetensors.index.json")])


def fingerprint(**parts: Any) -> str:
    """A short hash of JSON-serializable parts (stage key, file stats, counts)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def load_cache(path: Path, expected: str) -> dict[str, Tensor] | None:
    """The cached tensors, or None when there is no cache, it belongs to other inputs or its bytes are not those
    written (its digest beside it: a damaged cache is computed again, to the same values)."""
    if not path.is_file():
        return None
    digest = _digest_path(path)
    if not digest.is_file() or digest.read_text().strip() != file_digest(path):
        print(f"{path}: damaged or unverified (its bytes do not match {digest.name}); recomputing", flush=True)
        return None
    with safe_open(str(path), framework="pt") as f:
        found = (f.metadata() or {}).get(_FINGERPRINT_KEY)
        if found != expected:
            print(f"{path}: reference log-probs were computed for other inputs ({found} != {expected}); recomputing",
                  flush=True)
            return None
        return {name: f.get_tensor(name) for name in f.keys()}


def save_cache(path: Path, tensors: Mapping[str, Tensor], expected: str) -> None:
    """Write the cache atomically (temporary file, then rename): a killed write leaves no cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={_FINGERPRINT_KEY: expected})
    _digest_path(tmp).write_text(file_digest(tmp))
    os.replace(_digest_path(tmp), _digest_path(path))
    os.replace(tmp, path)


def _digest_path(path: Path) -> Path:
    return path.with_name(f"{path.name}.blake3")


class PrecomputedReference:
    """Reference log-probs looked up by a batch's row `index` in the precomputed table."""

    def __init__(self, chosen: Tensor, rejected: Tensor):
        self.chosen, self.rejected = chosen, rejected

    def __call__(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        index = batch["index"].cpu()
        device = batch["chosen_input_ids"].device
        return self.chosen[index].to(device), self.rejected[index].to(device)


class OnlineReference:
    """Reference log-probs computed for each batch under no_grad.

    `model` is a frozen copy (full fine-tuning) or the policy itself: its LoRA adapters are
    disabled for the reference forward, which then runs the frozen base weights. A frozen FSDP2
    copy is resharded after each forward (`release=True`), so only its shards stay in memory.
    """

    def __init__(self, model: Transformer, head: OutputHead, release: bool = False):
        self.model, self.head, self.release = model, head, release

    @torch.no_grad()
    def __call__(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        with disable_adapters(self.model):
            out = pair_logprobs(self.model, self.head, batch)
        if self.release:
            reshard(self.model)
        return out.chosen, out.rejected


def reference_scores(run: StageRun, model: Transformer, head: OutputHead, train: Batches, held_out: Split,
                     pair_files: list[Path], precompute: bool) -> dict[str, Tensor]:
    """The starting model's log-probs of the held-out pairs (and, with `precompute`, of every training pair).

    Runs before any checkpoint is loaded, so the weights are the starting model's; cached in the
    resume state, so a resumed run does not score again.
    """
    dpo = run.section
    cache_path = reference_cache_path(run.out)
    expected = fingerprint(key=run.cfg["key"], model=model_files(run.start_model()), pairs=file_stats(pair_files),
                           rows=len(train.dataset), held_out=len(held_out), loss=dpo["loss"], reference=dpo["reference"],
                           mixed_precision=run.memory["mixed_precision"])
    cached = load_cache(cache_path, expected)
    if cached is not None:
        return cached
    rows_per_rank = run.micro_batch_size() // run.dp_size
    splits = {"eval": (held_out, "reference: held-out pairs")} if len(held_out) else {}
    if precompute:
        splits["train"] = (train.dataset, "reference: training pairs")
    cached = {}
    with disable_adapters(model):
        for name, (dataset, desc) in splits.items():
            ref = score_pairs(model, head, dataset, train.collate, rows_per_rank, run.device, desc, run.is_main)
            cached.update({f"{name}_chosen": ref.chosen, f"{name}_rejected": ref.rejected,
                           f"{name}_chosen_tokens": ref.chosen_tokens, f"{name}_rejected_tokens": ref.rejected_tokens})
    for name, values in cached.items():
        if values.is_floating_point() and not bool(torch.isfinite(values).all()):
            row = int((~torch.isfinite(values)).nonzero()[0, 0])
            raise CheckpointError(f"{run.start_model()}: the reference model's log-probs ({name}) are NaN or inf from "
                                  f"pair {row} on; DPO against them would train on NaN")
    if run.is_main and cached:
        save_cache(cache_path, cached, expected)
    barrier()
    return cached
