"""Memory at Qwen3's real vocabulary: the longest sequence each side trains within a budget, and the peak at one size.

    python benchmarks/peers/memory_table.py [--budget-gib 3] [--layers 2] [--start-seq 512] [--max-seq 8192] [--fixed-seq 1024]

The model is `benchmarks/memory/sft_memory.py`'s (vocabulary 151,936, hidden 512, tied embeddings,
`--layers` blocks), random-init once and loaded by both sides. The workload is SFT with one
document of exactly `seq` tokens per row (no padding on either side; the first eighth is prompt,
not scored), `--batch` rows, AdamW, float32: one warm-up step and one measured step, so the peak
includes gradients, optimizer states and activations at once. Each probe is a freshly started
process (`benchmarks/_memory.py`) that imports only its own side's libraries, as a job would;
its peak is the process's resident-set high-water mark.
The search doubles the sequence length from `--start-seq`, each side in turn (`run.SIDES`), until
a side's peak exceeds the budget (or `--max-seq`); the table gives the longest length that
stayed within it. Steps at this vocabulary are slow on a CPU (each token costs ~0.5 GFLOP in the
output layer alone), so the default budget is small.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers_common import BENCHMARKS, EOS_ID, FIRST_WORD_ID, PAD_ID, Documents, Settings, save_tokenizer  # noqa: E402
from run import SIDES, environment, run_job, setup_job, write_json  # noqa: E402

from _memory import peak_memory  # noqa: E402

_MIB_PER_GIB = 1024


def full_rows(n: int, seq: int, vocab: int, seed: int = 0) -> Documents:
    """`n` documents of exactly `seq` tokens (labels aligned; the first eighth and the last token not scored)."""
    rng = np.random.default_rng(seed)
    ids, labels = [], []
    for _ in range(n):
        doc = rng.integers(FIRST_WORD_ID, vocab, size=seq)
        label = np.append(doc[1:], -100)
        label[: seq // 8] = -100
        ids.append(doc)
        labels.append(label)
    return ids, labels


def build_folder(layers: int, out: Path) -> Path:
    import torch
    from sft_memory import QWEN3_VOCAB, model_config

    from posttrain.model_files import save_hf_model
    from posttrain.models import Transformer

    hf_config = {**model_config(layers), "pad_token_id": PAD_ID, "eos_token_id": EOS_ID}
    torch.manual_seed(0)
    save_hf_model(Transformer(hf_config).state_dict(), hf_config, out)
    save_tokenizer(QWEN3_VOCAB, out)
    return out


def probe(side: str, folder: Path, seq: int, batch: int, threads: int, budget_mib: float) -> dict[str, Any]:
    """Peak memory of one side's SFT step at batch x seq, in a fresh process."""
    from sft_memory import QWEN3_VOCAB

    s = Settings(vocab=QWEN3_VOCAB, seq=seq, rows=batch, warmup=1, steps=1)
    documents = full_rows(s.total_steps * batch, seq, QWEN3_VOCAB)
    m = peak_memory(setup_job, run_job, side, "sft_padded", folder, s, threads, documents, device="cpu")
    return {"side": side, "seq": seq, "batch": batch, "peak_total_mib": m.baseline_mib + m.peak_mib,
            "peak_step_mib": m.peak_mib, "setup_mib": m.baseline_mib, "loss": m.result["losses"][-1],
            "seconds": m.seconds, "within_budget": m.baseline_mib + m.peak_mib <= budget_mib}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-gib", type=float, default=3.0, help="peak resident memory a probe may reach")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="rows per step")
    parser.add_argument("--start-seq", type=int, default=512)
    parser.add_argument("--max-seq", type=int, default=8192)
    parser.add_argument("--fixed-seq", type=int, default=1024, help="the size of the peak-memory comparison")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=BENCHMARKS.parent / "results" / "benchmarks" / "peers_memory.json")
    args = parser.parse_args(argv)
    if args.fixed_seq < args.start_seq:
        parser.error("--fixed-seq must be >= --start-seq (it is one of the searched sizes or measured on its own)")

    env = environment(args.threads)
    env["load_average_start"] = os.getloadavg()
    budget = args.budget_gib * _MIB_PER_GIB
    probes: list[dict[str, Any]] = []
    fits = {side: None for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="peers-memory-") as work:
        folder = build_folder(args.layers, Path(work) / "model")
        active, seq = list(SIDES), args.start_seq
        while active and seq <= args.max_seq:
            for side in list(active):
                row = probe(side, folder, seq, args.batch, args.threads, budget)
                probes.append(row)
                write_json(args.json, {"config": vars(args), "environment": env, "probes": probes, "partial": True})
                print(f"  {side:9} {args.batch} x {seq:6}: peak {row['peak_total_mib']:7.0f} MiB "
                      f"({'within' if row['within_budget'] else 'over'} {budget:.0f} MiB)", flush=True)
                if row["within_budget"]:
                    fits[side] = seq
                else:
                    active.remove(side)
            seq *= 2
        for side in SIDES:
            if not any(p["side"] == side and p["seq"] == args.fixed_seq for p in probes):
                probes.append(probe(side, folder, args.fixed_seq, args.batch, args.threads, budget))
    env["load_average_end"] = os.getloadavg()
    fixed = {p["side"]: p for p in probes if p["seq"] == args.fixed_seq}
    capped = {side: not any(p["side"] == side and not p["within_budget"] for p in probes) for side in SIDES}
    print(f"\nSFT, vocabulary 151,936, hidden 512, {args.layers} layers, float32, batch {args.batch}, "
          f"budget {args.budget_gib:g} GiB (whole-process peak)")
    print(f"{'side':9} {'longest seq within budget':>26} {f'peak MiB at {args.fixed_seq}':>18} "
          f"{f'step MiB at {args.fixed_seq}':>18}")
    for side in SIDES:
        longest = f"{fits[side]}" if fits[side] else f"< {args.start_seq}"
        if capped[side]:
            longest = f">= {fits[side]} (search cap)"
        print(f"{side:9} {longest:>26} {fixed[side]['peak_total_mib']:18.0f} {fixed[side]['peak_step_mib']:18.0f}")
    ratio_total = fixed["posttrain"]["peak_total_mib"] / fixed["trl"]["peak_total_mib"]
    ratio_step = fixed["posttrain"]["peak_step_mib"] / fixed["trl"]["peak_step_mib"]
    print(f"posttrain / TRL peak at {args.batch} x {args.fixed_seq}: {ratio_total:.2f} (process), "
          f"{ratio_step:.2f} (training); target <= 0.7: "
          f"{'met' if ratio_total <= 0.7 else 'MISSED'} / {'met' if ratio_step <= 0.7 else 'MISSED'}")
    result = {"config": vars(args), "environment": env, "probes": probes, "longest_within_budget": fits,
              "search_capped": capped, "fixed_size_ratio": {"process": ratio_total, "training": ratio_step}}
    write_json(args.json, result)
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
