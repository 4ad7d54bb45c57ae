"""Peak memory of one SFT training step: baseline, each memory feature alone, all together.

The model has Qwen3's real vocabulary (151,936) and hidden size 512 (a few layers, tied
embeddings as Qwen3-0.6B); one row of `--seq` tokens (2048), 1/8 of them prompt (ignored by the
loss). Each variant runs in a fresh process (`benchmarks/_memory.py`), built by the stage's own
setup (`posttrain.training.setup.build_model`, `posttrain.training.optimization.Optimization`) and
step (`posttrain.sft.step.sft_step`, what `stages/sft.py` runs): one warm-up step in setup allocates
optimizer states and loads kernels, then one measured step (forward, loss, backward, clip, optimizer step).

Reported per variant: `total` = memory held after setup (weights, gradients' absence, optimizer
states; on CPU also the process's libraries, the same for every variant) + the step's peak above it.
The all-features/baseline ratio uses `total`. Target (issue 4): <= 0.5x.

    python benchmarks/memory/sft_memory.py [--device cpu|cuda] [--layers 4] [--seq 2048] [--only baseline,chunked_ce]
"""

from __future__ import annotations

import sys
import argparse
import json
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH), *(str(d) for d in sorted(BENCH.glob("[a-z]*/")))]  # benchmarks/ and its groups
from _memory import peak_memory

ROOT = Path(__file__).resolve().parents[2]
QWEN3_VOCAB = 151_936

BASELINE_MEMORY = {
    "activation_checkpointing": 0,
    "optimizer_in_backward": False,
    "chunked_ce": False,
    "ce_chunks": 8,
    "low_bit_optimizer": None,
    "compile": None,
    "mixed_precision": False,
}
# Each memory feature alone (config overrides), then all of them together.
FEATURES: dict[str, dict[str, Any]] = {
    "chunked_ce": {"memory": {"chunked_ce": True}},
    "activation_checkpointing": {"memory": {"activation_checkpointing": 1}},
    "optimizer_in_backward": {"memory": {"optimizer_in_backward": True}, "sft": {"max_grad_norm": None}},
    "adamw8bit": {"memory": {"low_bit_optimizer": "adamw8bit"}},
    "mixed_precision": {"memory": {"mixed_precision": True}},
    "compile": {"memory": {"compile": "blocks"}},
    "lora": {"sft": {"method": "lora"}},
    "qlora": {"sft": {"method": "qlora"}},
}
ALL_FEATURES = ("chunked_ce", "activation_checkpointing", "optimizer_in_backward", "adamw8bit", "mixed_precision")


def model_config(layers: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "vocab_size": QWEN3_VOCAB,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
    }


def variant_config(names: tuple[str, ...]) -> dict[str, Any]:
    cfg = {
        "seed": 0,
        "model": {"backend": "native"},
        "memory": dict(BASELINE_MEMORY),
        "parallel": {"tp": 1, "dp_replicate": 1},
        "sft": {
            "method": "full",
            "lora": {"rank": 8, "alpha": 16, "dropout": 0.0,
                     "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
            "steps": 10, "lr": 1e-4, "warmup_steps": 0, "min_lr_ratio": 1.0, "weight_decay": 0.0,
            "grad_accum": 1, "max_grad_norm": 1.0, "skip_nonfinite": 0,
        },
    }
    for name in names:
        for section, values in FEATURES[name].items():
            cfg[section].update(values)
    return cfg


def setup(cfg: dict[str, Any], hf_config: dict[str, Any], seq: int, threads: int) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    from posttrain.losses.head import OutputHead
    from posttrain.parallel import build_mesh, init_distributed
    from posttrain.sft.step import sft_step
    from posttrain.training.optimization import Optimization
    from posttrain.training.setup import build_model

    info = init_distributed()  # on CUDA a one-process group: the stage's FSDP2 path (mixed precision)
    mesh = build_mesh(info)
    model = build_model(None, hf_config, info, mesh, cfg, cfg["sft"]["method"], cfg["sft"]["lora"])
    optimization = Optimization(model, cfg["sft"], cfg["memory"], mesh, "sft")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf_config["vocab_size"], (1, seq + 1), generator=gen)
    labels = ids[:, 1:].clone()
    labels[:, : seq // 8] = -100
    batch = {
        "input_ids": ids[:, :-1],
        "labels": labels,
        "document_ids": torch.zeros(1, seq, dtype=torch.long),
        "position_ids": torch.arange(seq)[None],
    }
    step = sft_step(model, OutputHead(model, mesh, cfg["memory"]), optimization, mesh, info.device, pad_id=-1)
    state = {"optimization": optimization, "step": step, "batch": {k: v.to(info.device) for k, v in batch.items()}}
    train_step(state)  # warm-up: optimizer states, kernels, lazy inits (and torchao's compile)
    return state


def train_step(state: dict[str, Any]) -> float:
    """The stage's step in `state` (SFT's `posttrain.sft.step`, DPO's `posttrain.dpo.step`) on the state's batch, then
    its optimizer step; the loss."""
    record = state["step"]([state["batch"]])
    state["optimization"].step(1, record["loss"])
    return record["loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=0, help="torch threads in each child (0: torch's default)")
    parser.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()

    variants: dict[str, tuple[str, ...]] = {"baseline": ()}
    variants["all"] = tuple(n for n in ALL_FEATURES if args.device == "cuda" or n != "mixed_precision")
    variants.update({name: (name,) for name in FEATURES})
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only.split(",")}
    hf_config = model_config(args.layers)
    rows = []
    print(f"{'variant':26} {'setup MiB':>10} {'step peak MiB':>14} {'total MiB':>10} {'vs base':>8} {'s':>7}  loss")
    base_total = None
    for name, features in variants.items():
        if args.device == "cpu" and "mixed_precision" in features:
            print(f"{name:26} skipped: mixed precision (bf16 FSDP2 params) needs CUDA; on CPU it stays float32")
            continue
        m = peak_memory(setup, train_step, variant_config(features), hf_config, args.seq, args.threads,
                        device=args.device)
        total = m.baseline_mib + m.peak_mib
        base_total = total if name == "baseline" else base_total
        ratio = total / base_total if base_total else float("nan")
        rows.append({"variant": name, "features": list(features), "setup_mib": m.baseline_mib,
                     "step_peak_mib": m.peak_mib, "total_mib": total, "ratio": ratio, "seconds": m.seconds,
                     "loss": m.result})
        print(f"{name:26} {m.baseline_mib:10.0f} {m.peak_mib:14.0f} {total:10.0f} {ratio:8.2f} {m.seconds:7.2f}  "
              f"{m.result:.4f}", flush=True)
    by_name = {r["variant"]: r for r in rows}
    if "all" in by_name and "baseline" in by_name:
        print(f"all features ({', '.join(by_name['all']['features'])}) / baseline: "
              f"{by_name['all']['ratio']:.2f}x (target <= 0.5x)")
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "layers": args.layers, "seq": args.seq,
                                         "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
