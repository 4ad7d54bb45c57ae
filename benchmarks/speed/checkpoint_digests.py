"""What verifying checkpoints costs: the time a checkpoint's manifest of digests adds to saving it, and the time a
resume spends checking it, measured in one run on one checkpoint.

    python benchmarks/speed/checkpoint_digests.py [--shape smollm2-135m] [--repeats 3] [--update docs/benchmarks.md]

A model of the shape (random weights, float32) with AdamW's state after one step is saved `--repeats` times through
the stages' `Checkpointer.save` (DCP's files, the rank's state, then the manifest: every file's sha256, size and
time); the digest part is then timed alone on the written folder, as is `damage`, the check a resume makes before
it loads. The shares are of the whole save. With `--update FILE` the table goes between FILE's
`<!-- checkpoint-digests:begin -->` and `<!-- checkpoint-digests:end -->` markers, with the machine and command.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _published

SHAPES = {  # the tiny preset's architecture at these sizes
    "tiny": {},
    "smollm2-135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--update", type=Path, metavar="FILE")
    args = parser.parse_args(argv)
    words = sys.argv[1:] if argv is None else list(argv)

    import torch

    from _published import machine_line, publish
    from posttrain.models import Transformer, preset_config
    from posttrain.training.checkpointer import Checkpointer, _digest, resume_dir
    from posttrain.utils.manifest import MANIFEST, damage

    torch.manual_seed(0)
    hf = {**preset_config("tiny"), **SHAPES[args.shape]}
    model = Transformer(hf)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randint(0, hf["vocab_size"], (1, 16))).float().mean().backward()
    optimizer.step()
    params = sum(p.numel() for p in model.parameters())

    saves, digests, checks, sizes = [], [], [], []
    root = Path(tempfile.mkdtemp(prefix="checkpoint-digests-", dir=os.environ.get("TMPDIR")))
    try:
        for repeat in range(args.repeats):
            out = root / f"run-{repeat}"
            checkpointer = Checkpointer(out, every=1, key="bench")
            start = time.perf_counter()
            folder = checkpointer.save(1, model, optimizer, None, {})
            saves.append(time.perf_counter() - start)
            sizes.append(sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()))
            (folder / MANIFEST).unlink()
            start = time.perf_counter()
            _digest(folder)
            digests.append(time.perf_counter() - start)
            start = time.perf_counter()
            assert damage(folder) is None
            checks.append(time.perf_counter() - start)
            shutil.rmtree(resume_dir(out))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    save, digest, check, size = (statistics.median(v) for v in (saves, digests, checks, sizes))
    mib = size / 2**20
    table = "\n".join([
        "| checkpoint | size | save (with manifest) | of which the digests | resume's check |",
        "|:--|--:|--:|--:|--:|",
        f"| {args.shape}, {params / 1e6:.1f}M parameters, AdamW | {mib:,.0f} MiB | {save:.2f} s | "
        f"{digest:.2f} s ({digest / save:.0%}; {mib / digest:,.0f} MiB/s) | {check:.2f} s ({mib / check:,.0f} MiB/s) |",
    ])
    footer = machine_line("benchmarks/speed/checkpoint_digests.py", words,
                          f"median of {args.repeats} saves to {root.parent} (its filesystem); torch {torch.__version__}")
    publish(table, footer, args.update, "checkpoint-digests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
