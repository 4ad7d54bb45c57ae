"""The parts of `benchmarks/gpu/gpu_check.sh`: NCCL and bf16 sanity, SFT throughput of posttrain and TRL, the report.

    python -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/gpu/gpu_check.py ours --out OUT --work WORK [--dry]
    python benchmarks/gpu/gpu_check.py trl --out OUT --work WORK [--dry]
    python benchmarks/gpu/gpu_check.py report --out OUT

`ours` runs in the stage's process setup (a one-process NCCL group, FSDP2 with bf16 mixed
precision): an all_reduce check, a bf16 matmul check, then SFT of a random-init Qwen3-0.6B-shaped
model at batch 2 x 2048 with chunked cross-entropy and optimizer-in-backward, three ways: eager on
padded rows (one document per row), `torch.compile` (per block) on padded rows, and packing
(per-document attention) with compile. `trl` runs SFTTrainer on the same model folder and
documents the same three ways (bf16 autocast, `torch_compile`, TRL's padding-free packing) when
`trl` is importable, and records why not otherwise. `report` prints one table beside the
torchtune paper's anchors and writes `gpu_check.json`.

Throughput counts useful (non-pad) tokens per second over the timed steps (after warm-up steps
that include compilation), as `benchmarks/peers/peers_common.py` defines them; the processed
(padded) tokens per second is given too. `--dry` runs everything on CPU with tiny shapes and one
thread; there torch.compile uses its "eager" backend (graph capture without Inductor's code
generation) so the compile path runs in seconds. Missing packages (trl, datasets) are recorded
as the reason a part did not run, not as a failure.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCHMARKS), *(str(d) for d in sorted(BENCHMARKS.glob("[a-z]*/")))]  # benchmarks/ and its groups

# torchtune paper, Qwen3-0.6B SFT on one H100 (useful tokens/s): eager, + torch.compile, + packing.
PAPER_ANCHORS = {"eager": 5200.0, "compile": 7900.0, "packing": 57000.0}
VARIANTS = {  # name: (packed rows, torch.compile)
    "eager": (False, False),
    "compile": (False, True),
    "packing": (True, True),
}
ROWS_X_SEQ = {False: (2, 2048), True: (2, 64)}  # by --dry
OUR_FEATURES = ("chunked_ce", "optimizer_in_backward", "mixed_precision")
TRL_INSTALL_HINT = "pip install 'posttrain[bench]' (trl, datasets)"


def qwen3_06b_config(dry: bool) -> dict[str, Any]:
    """Qwen3-0.6B's shape (random init), or a tiny model of the same architecture for --dry."""
    from peers_common import EOS_ID, PAD_ID

    shape = (
        {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
        if dry else
        {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151_936}
    )
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
            "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
            "attention_bias": False, "initializer_range": 0.02, "tie_word_embeddings": True,
            "use_sliding_window": False, "pad_token_id": PAD_ID, "eos_token_id": EOS_ID, **shape}


def settings(dry: bool):
    from peers_common import Settings

    rows, seq = ROWS_X_SEQ[dry]
    warmup, steps = (1, 1) if dry else (3, 10)  # the GPU warm-up steps include torch.compile's compilation
    return Settings(vocab=qwen3_06b_config(dry)["vocab_size"], seq=seq, rows=rows, warmup=warmup, steps=steps)


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def _check(name: str, fn, results: dict[str, Any]) -> None:
    """Run one check; a failure is recorded with its traceback and does not stop the others."""
    try:
        results[name] = {"ok": True, **fn()}
    except Exception as e:  # noqa: BLE001 - every failure goes into the report
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(f"[gpu_check] {name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def all_reduce_check() -> dict[str, Any]:
    """all_reduce of [rank + 1] over the process group: every rank must get the sum."""
    import torch
    import torch.distributed as dist

    from posttrain.parallel import init_distributed

    info = init_distributed()
    if not dist.is_initialized():
        raise RuntimeError("no process group: launch with torchrun")
    x = torch.full((1024,), float(info.rank + 1), device=info.device)
    dist.all_reduce(x)
    expected = info.world_size * (info.world_size + 1) / 2
    if not torch.all(x == expected):
        raise RuntimeError(f"all_reduce gave {x[0].item()}, expected {expected}")
    return {"backend": dist.get_backend(), "world_size": info.world_size, "device": str(info.device)}


def bf16_matmul_check(dry: bool) -> dict[str, Any]:
    """bf16 matmul against a float32 reference (relative error) and its speed."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = 256 if dry else 8192
    gen = torch.Generator(device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen)
    b = torch.randn(n, n, device=device, generator=gen)
    reference = a @ b
    low = a.bfloat16() @ b.bfloat16()
    rel = float((low.float() - reference).norm() / reference.norm())
    if rel > 2e-2:
        raise RuntimeError(f"bf16 matmul relative error {rel:.3g} > 2e-2")
    reps = 2 if dry else 20
    a16, b16 = a.bfloat16(), b.bfloat16()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a16 @ b16
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / reps
    return {"n": n, "relative_error": rel, "tflops": 2 * n**3 / seconds / 1e12, "device": str(device)}


def _peak_reset() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def _throughput(result: dict[str, Any], s) -> dict[str, Any]:
    return {"useful_tokens_per_s": result["useful_tokens"] / result["seconds"],
            "tokens_per_s": s.steps * s.rows * s.seq / result["seconds"],
            "step_s": result["seconds"] / result["steps"], "final_loss": result["losses"][-1],
            "peak_gib": _peak_gib()}


def use_eager_compile_backend() -> None:
    """--dry: make `nn.Module.compile` use the "eager" backend (Dynamo capture, no Inductor code generation)."""
    import torch

    compile_module = torch.nn.Module.compile

    def compile_eager(self, *args, **kwargs):
        kwargs.setdefault("backend", "eager")
        return compile_module(self, *args, **kwargs)

    torch.nn.Module.compile = compile_eager


def build_folder(work: Path, dry: bool) -> Path:
    from peers_common import build_model_folder

    folder = work / "model"
    if not (folder / "config.json").is_file():
        build_model_folder(qwen3_06b_config(dry), folder)
    return folder


def documents(dry: bool):
    from peers_common import sft_document_count, sft_documents

    s = settings(dry)
    return sft_documents(s, sft_document_count(s))


def run_ours(args: argparse.Namespace) -> None:
    """Environment, all_reduce, bf16 and posttrain's three SFT variants; ours.json is rewritten after each."""
    import torch.distributed as dist

    environment(args)
    results: dict[str, Any] = {}
    _check("all_reduce", all_reduce_check, results)
    _check("bf16_matmul", lambda: bf16_matmul_check(args.dry), results)
    _write(args.out / "ours.json", results)
    if args.dry:
        use_eager_compile_backend()
    folder = build_folder(args.work, args.dry)
    docs, s = documents(args.dry), settings(args.dry)
    sft: dict[str, Any] = {}
    for name, (packed, compiled) in VARIANTS.items():
        def variant(packed: bool = packed, compiled: bool = compiled) -> dict[str, Any]:
            import peers_ours

            _peak_reset()
            features = OUR_FEATURES + (("compile",) if compiled else ())
            state = peers_ours.setup_sft(folder, s, packed, documents=docs, features=features)
            out = _throughput(peers_ours.run(state), s)
            del state
            return {"features": list(features), **out}

        _check(name, variant, sft)
        print(f"[gpu_check] posttrain {name}: {json.dumps(sft[name])[:300]}", flush=True)
        _write(args.out / "ours.json", {**results, "sft": sft})
    if dist.is_initialized():
        dist.destroy_process_group()


def run_trl(args: argparse.Namespace) -> None:
    missing = [m for m in ("trl", "datasets", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        reason = f"not run: {', '.join(missing)} not installed ({TRL_INSTALL_HINT})"
        print(f"[gpu_check] TRL {reason}", flush=True)
        _write(args.out / "trl.json", {"skipped": reason})
        return
    import torch

    import peers_trl

    folder = build_folder(args.work, args.dry)
    docs, s = documents(args.dry), settings(args.dry)
    bf16 = torch.cuda.is_available()
    sft: dict[str, Any] = {}
    for name, (packed, compiled) in VARIANTS.items():
        def variant(packed: bool = packed, compiled: bool = compiled) -> dict[str, Any]:
            _peak_reset()
            backend = ("eager" if args.dry else "inductor") if compiled else None
            state = peers_trl.setup_sft(folder, s, packed, documents=docs, bf16=bf16, compile_backend=backend)
            out = _throughput(peers_trl.run(state), s)
            del state
            return {"bf16": bf16, "torch_compile": backend, **out}

        _check(name, variant, sft)
        print(f"[gpu_check] TRL {name}: {json.dumps(sft[name])[:300]}", flush=True)
        _write(args.out / "trl.json", {"trl": peers_trl.trl_version(), "sft": sft})


def _fmt(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def report(args: argparse.Namespace) -> int:
    """One table (ours, TRL, paper anchor) and gpu_check.json; exit status 1 when a check failed."""
    def load(name: str) -> dict[str, Any]:
        path = args.out / name
        return json.loads(path.read_text()) if path.is_file() else {"missing": f"{path} was not written"}

    ours, trl = load("ours.json"), load("trl.json")
    env = load("environment.json")
    failed = [k for k in ("all_reduce", "bf16_matmul") if not ours.get(k, {}).get("ok")]
    failed += [f"posttrain {k}" for k, v in ours.get("sft", {}).items() if not v.get("ok")]
    failed += [f"trl {k}" for k, v in trl.get("sft", {}).items() if not v.get("ok")]
    if "missing" in ours:
        failed.append(ours["missing"])

    print(f"\ngpu_check: {env.get('gpu', 'no GPU')} | torch {env.get('torch')} | {env.get('date')}"
          f"{' | DRY RUN (CPU, tiny shapes)' if args.dry else ''}")
    for name in ("all_reduce", "bf16_matmul"):
        r = ours.get(name, {})
        detail = r.get("error") or ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in r.items() if k not in ("ok", "traceback"))
        print(f"  {name:12} {'ok' if r.get('ok') else 'FAILED'}  {detail}")
    rows, seq = ROWS_X_SEQ[args.dry]
    shape = f"SFT, {'tiny Qwen3' if args.dry else 'Qwen3-0.6B'} shape, {rows} x {seq}"
    header = (f"{shape:34} {'posttrain useful tok/s':>23} {'(padded tok/s)':>15} "
              f"{'TRL useful tok/s':>17} {'paper (1xH100)':>15} {'posttrain/paper':>16} {'peak GiB':>9}")
    print(header)
    rows = []
    for name in VARIANTS:
        o = ours.get("sft", {}).get(name, {})
        t = trl.get("sft", {}).get(name, {})
        useful = o.get("useful_tokens_per_s")
        anchor = PAPER_ANCHORS[name]
        trl_text = _fmt(t.get("useful_tokens_per_s")) if "sft" in trl else "n/a"
        print(f"  {name:32} {_fmt(useful) if o.get('ok') else 'FAILED':>23} {_fmt(o.get('tokens_per_s')):>15} "
              f"{trl_text:>17} {anchor:>15,.0f} {_fmt(useful / anchor if useful else None, '.2f'):>16} "
              f"{_fmt(o.get('peak_gib'), '.1f'):>9}")
        rows.append({"variant": name, "posttrain": o, "trl": t or None, "paper_anchor": anchor,
                     "posttrain_over_paper": useful / anchor if useful else None})
    if "skipped" in trl:
        print(f"  TRL: {trl['skipped']}")
    print("  variants: eager = padded rows; compile = padded rows + torch.compile; packing = packed rows + torch.compile."
          " posttrain: chunked CE + optimizer-in-backward + bf16 FSDP2. Paper anchors are the torchtune paper's figures.")
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    _write(args.out / "gpu_check.json", {"dry": args.dry, "environment": env, "checks": {
        k: ours.get(k) for k in ("all_reduce", "bf16_matmul")}, "sft": rows, "trl": trl, "failed": failed})
    return 1 if failed else 0


def environment(args: argparse.Namespace) -> None:
    """Versions and device of this run, to environment.json."""
    import datetime
    import platform

    import torch

    env = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
           "torch": torch.__version__, "cuda": torch.version.cuda, "dry": args.dry}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    for name in ("transformers", "accelerate", "trl", "datasets", "peft"):
        spec = importlib.util.find_spec(name)
        env[name] = None
        if spec is not None:
            from importlib.metadata import PackageNotFoundError, version

            try:
                env[name] = version(name)
            except PackageNotFoundError:
                env[name] = "unknown"
    _write(args.out / "environment.json", env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["ours", "trl", "report"])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON figures")
    parser.add_argument("--work", type=Path, help="scratch folder for the shared model (ours, trl)")
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shapes")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part in ("ours", "trl") and args.work is None:
        parser.error(f"{args.part} needs --work")
    if args.dry and args.part != "report":
        import torch

        torch.set_num_threads(1)  # a loaded CPU: one thread avoids OpenMP spin contention
    if args.part == "report":
        sys.exit(report(args))
    {"ours": run_ours, "trl": run_trl}[args.part](args)


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    main()
