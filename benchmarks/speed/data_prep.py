"""Rows/s and useful-token fraction of our SFT tokenize+pack against a plain baseline, same data.

    python benchmarks/speed/data_prep.py [--rows 4000] [--max-seq-len 128] [--batch-size 16] [--tokenizer DIR]

Ours: `posttrain.data.tokenize.sft_split` (chat template, assistant loss mask, truncation, packing
into `max_seq_len` rows with document boundaries). Baseline, as a TRL-style SFT pipeline does it:
`datasets.map` with `transformers` `apply_chat_template(tokenize=True)` (no loss mask), then
batches of `--batch-size` rows in a seeded random order padded to the longest row with
`tokenizer.pad`. Useful-token fraction = real tokens / token slots the model computes on. Data:
the default config's SFT split of the built-in tasks; tokenizer: a BPE trained on it, or a folder.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
import yaml

from posttrain.data.sources import canonical_rows
from posttrain.data.tasks import make_splits
from posttrain.data.tokenize import sft_split, tokenizer_training_text
from posttrain.tokenizer import Tokenizer, train_bpe_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def baseline(rows: list[dict], folder: Path, max_len: int, batch_size: int) -> tuple[float, float]:
    """(seconds, useful-token fraction) of datasets.map tokenization + pad-to-longest batches."""
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    start = time.perf_counter()
    ds = datasets.Dataset.from_list(rows).map(
        lambda batch: {"input_ids": hf.apply_chat_template(batch["messages"], tokenize=True, return_dict=False,
                                                           truncation=True, max_length=max_len)},
        batched=True, remove_columns=["messages"],
    )
    order = np.random.default_rng(0).permutation(len(ds))
    real = slots = 0
    for i in range(0, len(order), batch_size):
        batch = hf.pad({"input_ids": ds[order[i : i + batch_size]]["input_ids"]}, return_tensors="pt")
        real += int(batch["attention_mask"].sum())
        slots += batch["input_ids"].numel()
    return time.perf_counter() - start, real / slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--tokenizer", type=Path, default=None, help="HF tokenizer folder (default: train a BPE)")
    args = parser.parse_args()
    datasets.disable_progress_bars()

    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    generated = make_splits(cfg["data"]["tasks"], {"sft": args.rows}, cfg["seed"])["sft"]
    rows, _ = canonical_rows(generated, "sft", "data.tasks")
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.tokenizer
        if folder is None:
            folder = Path(tmp) / "tokenizer"
            train_bpe_tokenizer(tokenizer_training_text({"sft": rows}), cfg["data"]["vocab_size"], folder, model_max_length=args.max_seq_len)
        tok = Tokenizer(folder)

        start = time.perf_counter()
        _, stats = sft_split(rows, tok, args.max_seq_len, "assistant", "right", packing=True)
        ours_s, ours_useful = time.perf_counter() - start, stats["packing_efficiency"]
        base_s, base_useful = baseline(rows, folder, args.max_seq_len, args.batch_size)

    n = len(rows)
    print(f"data: {n} SFT rows of the default tasks, max_seq_len {args.max_seq_len}, vocab {tok.vocab_size}")
    print(f"{'':34s}{'rows/s':>10s}{'useful tokens':>15s}")
    print(f"{'ours (mask + pack)':34s}{n / ours_s:10.0f}{ours_useful:15.3f}")
    print(f"{'baseline (map + pad to longest)':34s}{n / base_s:10.0f}{base_useful:15.3f}")
    print(f"ratio ours/baseline: rows/s {base_s / ours_s:.2f}x, useful-token fraction {ours_useful / base_useful:.2f}x")


if __name__ == "__main__":
    main()
