"""Where an SFT training step's time goes: attention, matmuls, loss, optimizer, communication, the rest,
and the host's share, with the step's model FLOP utilization (MFU). One process, `torch.profiler`.

    python -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/speed/profile_step.py \
        --variant packing --json OUT/profile_packing.json [--dry]

The step is `benchmarks/gpu/gpu_check.py`'s (random-init Qwen3-0.6B shape, batch 2 x 2048, chunked
cross-entropy, optimizer-in-backward, bf16 FSDP2 on one rank; `--variant` eager | compile |
packing). After the warm-up steps (compilation included) the timed steps run under the profiler;
each kernel's own time (device time on a GPU, CPU time on a CPU) goes to the first category whose
pattern its name contains (`CATEGORIES`, in order). `host` is the steps' wall time not covered by
that total: launch overhead, Python, waiting. MFU is the model FLOPs per step (6 x parameters x
tokens, plus causal attention's 6 x layers x hidden x sequence x tokens) over the wall time,
divided by the bf16 matmul rate measured in the same process (`peak_tflops`, also printed).
`--dry` runs a tiny model on the CPU in seconds (the suite runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCHMARKS), *(str(d) for d in sorted(BENCHMARKS.glob("[a-z]*/")))]  # benchmarks/ and its groups

# Category -> substrings of kernel / op names (lower case), matched in this order.
CATEGORIES = {
    "attention": ("flash", "attention", "sdpa", "flex", "varlen", "fmha"),
    "communication": ("nccl", "all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce", "c10d",
                      "broadcast"),
    "loss": ("cross_entropy", "log_softmax", "logsoftmax", "logsumexp", "nll_loss", "nllloss", "softmax"),
    "optimizer": ("adam", "_foreach", "optimizer", "lerp", "addcdiv", "sqrt"),
    "matmul": ("gemm", "matmul", "::mm", "addmm", "bmm", "linear", "cutlass", "xmma", "nvjet", "cublas", "mkldnn"),
}
OTHER, HOST = "other", "host"


def category(name: str) -> str:
    lower = name.lower()
    return next((c for c, patterns in CATEGORIES.items() if any(p in lower for p in patterns)), OTHER)


def breakdown(events: Iterable[tuple[str, float]], wall_s: float) -> dict[str, float]:
    """Seconds per category from (name, own seconds) pairs; `host` is the wall time they leave uncovered."""
    out = {name: 0.0 for name in (*CATEGORIES, OTHER)}
    for name, seconds in events:
        out[category(name)] += seconds
    out[HOST] = max(wall_s - sum(out.values()), 0.0)
    return out


def model_flops_per_token(config: dict[str, Any], params: int, seq: int) -> float:
    """6 N (forward and backward of every weight) + 6 L d S (causal attention scores and values)."""
    return 6.0 * params + 6.0 * config["num_hidden_layers"] * config["num_attention_heads"] * config["head_dim"] * seq


def matmul_tflops(device, dry: bool) -> float:
    """The bf16 matmul rate this device reaches on square matrices (the MFU denominator)."""
    import torch

    n, reps = (256, 4) if dry else (8192, 20)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(2):
        a @ b
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2.0 * n**3 * reps / (time.perf_counter() - start) / 1e12


def profile(variant: str, dry: bool, work: Path) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    import gpu_check
    import peers_ours

    packed, compiled = gpu_check.VARIANTS[variant]
    if dry:
        gpu_check.use_eager_compile_backend()
    s = gpu_check.settings(dry)
    folder = gpu_check.build_folder(work, dry)
    features = gpu_check.OUR_FEATURES + (("compile",) if compiled else ())
    state = peers_ours.setup_sft(folder, s, packed, documents=gpu_check.documents(dry), features=features)
    device = state["device"]
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    batches = list(state["data"])
    for step, batch in enumerate(batches[: s.warmup]):
        peers_ours.train_one(state, batch, step)
    if cuda:
        torch.cuda.synchronize()
    useful = 0
    with torch_profile(activities=activities) as prof:
        start = time.perf_counter()
        for step, batch in enumerate(batches[s.warmup :], start=s.warmup):
            useful += peers_ours.train_one(state, batch, step)[1]
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    own = [(e.key, (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6) for e in averages]
    seconds = breakdown(own, wall)
    config = json.loads((folder / "config.json").read_text())
    params = sum(p.numel() for p in state["model"].parameters())
    tokens = s.steps * s.rows * s.seq
    achieved = model_flops_per_token(config, params, s.seq) * tokens / wall / 1e12
    peak = matmul_tflops(device, dry)
    top = sorted(own, key=lambda e: -e[1])[:15]
    return {
        "variant": variant, "dry": dry, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "features": list(features), "rows": s.rows, "seq": s.seq, "steps": s.steps, "params": params,
        "step_s": wall / s.steps, "useful_tokens_per_s": useful / wall, "tokens_per_s": tokens / wall,
        "model_tflops": achieved, "peak_tflops": peak, "mfu": achieved / peak,
        "seconds_per_step": {k: v / s.steps for k, v in seconds.items()},
        "share": {k: v / wall for k, v in seconds.items()},
        "top_ops": [{"name": name, "category": category(name), "ms_per_step": 1e3 * t / s.steps} for name, t in top],
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"{result['variant']} on {result['device']}: {result['step_s'] * 1e3:.1f} ms/step, "
          f"{result['useful_tokens_per_s']:,.0f} useful tokens/s, MFU {result['mfu']:.1%} "
          f"({result['model_tflops']:.1f} of {result['peak_tflops']:.1f} TFLOP/s measured bf16 matmul)")
    for name, seconds in result["seconds_per_step"].items():
        print(f"  {name:<14} {seconds * 1e3:9.2f} ms/step  {result['share'][name]:6.1%}")
    print("  top ops (own time):")
    for op in result["top_ops"][:8]:
        print(f"    {op['ms_per_step']:9.2f} ms  {op['category']:<13} {op['name'][:90]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", choices=["eager", "compile", "packing"], default="packing")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--work", type=Path, default=Path("benchmarks/out/profile"), help="model folder cache")
    parser.add_argument("--dry", action="store_true", help="a tiny model on the CPU")
    args = parser.parse_args(argv)
    if args.dry:
        import torch

        torch.set_num_threads(1)
    args.work.mkdir(parents=True, exist_ok=True)
    result = profile(args.variant, args.dry, args.work)
    print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
