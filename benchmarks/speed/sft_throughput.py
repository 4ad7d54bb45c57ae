"""SFT training throughput in useful (non-pad) tokens/s: packed vs padded rows, and each feature's cost.

Documents with a skewed length distribution (most short, a long tail; lognormal, clipped to
`--seq`) are laid out the two ways data prep can (`posttrain.data.packing.pack_or_pad`): packed
with per-document attention, or one padded document per row. All train the same model with the
same rows per step, each batch cut after its last trained token (padded rows cost their batch's
longest document, not the row length). Padded rows run twice: as stored (the classic padded
batch) and as the SFT loader batches them (padding-free: the rows' trained spans repacked into as
few rows as fit). packed / padded-as-stored is what packing buys over padding; padding-free /
as-stored what the loader buys when data prep did not pack.
Then, on packed rows, each memory feature alone shows its speed cost against the baseline.
The step is the stage's own (`build_model`, `Optimization`, `posttrain.sft.step.sft_step`);
`--warmup` steps (compilation, lazy states) are not timed, `--steps` are.

    python benchmarks/speed/sft_throughput.py [--device cpu|cuda] [--seq 256] [--rows 8] [--steps 5]

Target (issue 4): packed >= 2x padded.
"""

from __future__ import annotations

import sys
import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain.data.loader import length_multiple, sft_rows_batch
from posttrain.data.packing import pack_or_pad
from posttrain.losses.head import OutputHead
from posttrain.models import preset_config
from posttrain.sft.step import sft_step
from posttrain.training.optimization import Optimization
from posttrain.training.setup import build_model
BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH), *(str(d) for d in sorted(BENCH.glob("[a-z]*/")))]  # benchmarks/ and its groups
from _documents import skewed_documents
from sft_memory import variant_config

FEATURES = ("chunked_ce", "activation_checkpointing", "optimizer_in_backward", "adamw8bit", "compile", "lora")
PAD_ID = 0


def stored_batches(rows: dict[str, np.ndarray], batch_rows: int) -> list[tuple[list[torch.Tensor], int]]:
    """Consecutive groups of rows as stored (`input_ids`, `labels`, `document_ids`), each with its
    useful tokens: the non-pad tokens of the rows as stored, whatever the batching."""
    out = []
    for start in range(0, len(rows["input_ids"]) - batch_rows + 1, batch_rows):
        stored = [torch.from_numpy(rows[k][start : start + batch_rows].astype(np.int64))
                  for k in ("input_ids", "labels", "document_ids")]
        out.append((stored, int((stored[0] != PAD_ID).sum())))
    return out


def batches(rows: dict[str, np.ndarray], batch_rows: int, memory: dict[str, Any], repack: bool = True
            ) -> list[tuple[dict[str, torch.Tensor], int]]:
    """Consecutive rows as the SFT stage's loader batches them under the `memory` settings
    (`repack=False`: rows as stored, trimmed only)."""
    multiple = length_multiple(memory["compile"] is not None)
    return [(sft_rows_batch(*stored, repack=repack, multiple=multiple), useful)
            for stored, useful in stored_batches(rows, batch_rows)]


def tokens_per_second(cfg: dict[str, Any], hf_config: dict[str, Any], data: list[tuple[dict[str, torch.Tensor], int]],
                      warmup: int, steps: int, device: torch.device) -> dict[str, float]:
    from posttrain.parallel import DistInfo

    info = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    model = build_model(None, hf_config, info, None, cfg, cfg["sft"]["method"], cfg["sft"]["lora"])
    optimization = Optimization(model, cfg["sft"], cfg["memory"], None, "sft")
    train_step = sft_step(model, OutputHead(model, None, cfg["memory"]), optimization, None, device, pad_id=-1)
    useful, seconds = 0, 0.0
    for i in range(warmup + steps):
        stored, tokens = data[i % len(data)]
        batch = {k: v.to(device) for k, v in stored.items()}
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        optimization.step(i + 1, train_step([batch])["loss"])
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            seconds += time.perf_counter() - t0
            useful += tokens
    return {"useful_tokens_per_s": useful / seconds, "step_s": seconds / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="tiny", help="a preset (posttrain.models.presets)")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rows", type=int, default=8, help="rows per step")
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--features", default=",".join(FEATURES), help="comma-separated features to time")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()

    device = torch.device(args.device)
    hf_config = preset_config(args.model, vocab_size=args.vocab)
    ids, labels = skewed_documents(args.docs, args.seq, args.vocab, seed=0)
    layouts = {name: pack_or_pad(ids, labels, args.seq, PAD_ID, packing=packing)
               for name, packing in (("packed", True), ("padded", False))}
    lengths = np.array([len(d) for d in ids])
    print(f"{len(ids)} documents, length median {np.median(lengths):.0f}, mean {lengths.mean():.0f}, "
          f"max {lengths.max()} (rows of {args.seq}); packed rows {len(layouts['packed']['input_ids'])}, "
          f"padded rows {len(layouts['padded']['input_ids'])}")

    results = []
    runs = [("padded (as stored)", "padded", ()), ("padded (padding-free)", "padded", ()),
            ("packed", "packed", ())]
    runs += [(f"packed + {f}", "packed", (f,)) for f in args.features.split(",") if f]
    print(f"{'run':36} {'useful tok/s':>13} {'step s':>8} {'vs packed':>10}")
    packed = None
    for name, layout, features in runs:
        cfg = variant_config(features)
        data = batches(layouts[layout], args.rows, cfg["memory"], repack=name != "padded (as stored)")
        r = tokens_per_second(cfg, hf_config, data, args.warmup, args.steps, device)
        packed = r["useful_tokens_per_s"] if name == "packed" else packed
        rel = r["useful_tokens_per_s"] / packed if packed else float("nan")
        results.append({"run": name, **r, "vs_packed": rel})
        print(f"{name:36} {r['useful_tokens_per_s']:13.0f} {r['step_s']:8.3f} {rel:10.2f}", flush=True)
    as_stored, padding_free = results[0]["useful_tokens_per_s"], results[1]["useful_tokens_per_s"]
    speedup = results[2]["useful_tokens_per_s"] / as_stored
    print(f"packed / padded (as stored) useful tokens/s: {speedup:.2f}x (target >= 2x); "
          f"padded, padding-free / as stored: {padding_free / as_stored:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "seq": args.seq, "rows": args.rows,
                                         "packed_over_padded": speedup, "padding_free_over_padded": padding_free / as_stored,
                                         "runs": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
