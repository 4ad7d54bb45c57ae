"""Activation memory per rank of one training step at a long sequence: context parallelism over 2 ranks vs 1.

Each layout runs in fresh processes (gloo on CPU, NCCL on CUDA): cp=1 is one process on the whole row,
cp=2 two processes on half of it each (`parallel.cp`, head-tail chunks, keys and values gathered per
layer). The model is built as the stages build it (meta device, `parallelize`, weights broadcast from
rank 0) and the loss is SFT's (`posttrain.losses.head.summed_lm_loss`) on one packed row of `--seq`
tokens (documents of `--doc` tokens). Measured on rank 0, for the forward and backward of one step:

- `saved_mib`: the activations autograd keeps for backward (the bytes of every distinct storage its
  saved-tensor hook sees, weights left out): the activation memory proper, the same on any device;
- `peak_mib`: the process's peak above the level before the step (CPU: resident-set high-water mark
  after `clear_refs`; CUDA: `max_memory_allocated`), which also counts temporaries (attention scores).

The cp2/cp1 ratios are printed; 0.5 would be a perfect split (the gathered keys and values are the part
that is not split).

    python benchmarks/memory/cp_memory.py [--seq 4096] [--layers 4] [--hidden 256] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

_MIB = 1024 * 1024


def model_config(args: argparse.Namespace) -> dict:
    return {"model_type": "qwen3", "vocab_size": 4096, "hidden_size": args.hidden, "intermediate_size": 3 * args.hidden,
            "num_hidden_layers": args.layers, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": args.hidden // 8, "tie_word_embeddings": True, "initializer_range": 0.02}


def _rss_kib(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE).group(1))


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(max(1, args.threads // world))
    from posttrain.losses.head import OutputHead, summed_lm_loss
    from posttrain.models import Transformer
    from posttrain.parallel import (build_mesh, destroy, init_distributed, load_full_state_dict, materialize,
                                    parallelize)

    info = init_distributed()
    cp = world
    mesh = build_mesh(info, cp=cp)
    config = model_config(args)
    if mesh is None:
        torch.manual_seed(0)
        model = Transformer(config).to(info.device)
    else:
        with torch.device("meta"):
            model = Transformer(config)
        parallelize(model, mesh, {}, {"cp": cp})
        materialize(model, info.device, init=False)
        torch.manual_seed(0)
        load_full_state_dict(model, Transformer(config).state_dict() if info.is_main else {}, broadcast_from_rank0=True)
    head = OutputHead(model, mesh, {"chunked_ce": True, "ce_chunks": 8})
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config["vocab_size"], (1, args.seq), generator=g)
    docs = (torch.arange(args.seq) // args.doc)[None]
    batch = {"input_ids": ids.to(info.device), "labels": ids.roll(-1, 1).to(info.device),
             "document_ids": docs.to(info.device), "position_ids": None}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not (t.is_leaf and t.requires_grad):  # weights are not activations
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    summed_lm_loss(model, head, batch).backward()  # warm-up: kernels, gradient buffers
    model.zero_grad(set_to_none=False)
    if info.device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_kib("VmRSS") * 1024
        Path("/proc/self/clear_refs").write_text("5")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = summed_lm_loss(model, head, batch)
    loss.backward()
    peak = (torch.cuda.max_memory_allocated() if info.device.type == "cuda" else _rss_kib("VmHWM") * 1024) - base
    if info.is_main:
        Path(out).write_text(json.dumps({"saved_mib": sum(seen.values()) / _MIB, "peak_mib": peak / _MIB,
                                         "loss": loss.item()}))
    destroy()


def measure(world: int, args: argparse.Namespace) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.spawn(worker, args=(world, port, args, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--doc", type=int, default=1024, help="tokens per packed document")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all (split over the ranks)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("cp=2 on CUDA needs 2 GPUs (one per rank)")
    results = {f"cp{world}": measure(world, args) for world in (1, 2)}
    for name, r in results.items():
        print(f"{name}: saved activations {r['saved_mib']:.1f} MiB, step peak {r['peak_mib']:.1f} MiB per rank, "
              f"loss {r['loss']:.5f}")
    one, two = results["cp1"], results["cp2"]
    print(f"ratio cp2/cp1 per rank: saved activations {two['saved_mib'] / one['saved_mib']:.3f}, "
          f"step peak {two['peak_mib'] / one['peak_mib']:.3f} (seq {args.seq}, {args.layers} layers, hidden "
          f"{args.hidden}, {args.device})")
    print(json.dumps({"args": vars(args), **results}))


if __name__ == "__main__":
    main()
