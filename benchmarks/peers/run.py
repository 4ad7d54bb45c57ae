"""posttrain (native and transformers backend) vs TRL on the same workloads: useful tokens/s, steps/s, peak memory and
final loss, side by side.

    python benchmarks/peers/run.py [--workloads sft,dpo,grpo] [--steps 3] [--warmup 1] [--rounds 1] [--json out.json]
    python benchmarks/peers/run.py --table out.json      # a saved run's tables, as docs/benchmarks.md shows them

Workloads (`sft` stands for both SFT layouts): `sft_padded`, `sft_packed`, `dpo`, `grpo`. Both
sides start from one random-init Qwen3-architecture model saved once as an HF folder, train on
the same synthetic data with the same batch size, sequence length, AdamW settings and precision
(float32 on CPU); `peers_common.py` defines the data and what counts as a useful token,
`peers_ours.py` and `peers_trl.py` the sides. Three sides: `posttrain` (the native port),
`posttrain-hf` (the same stages with `model.backend: transformers`, the fallback every family without a
native port runs on, so users know what it costs) and `trl`. Every run is a freshly started process
(`benchmarks/_memory.py`) that imports only its own side's libraries (posttrain's native runs never load
transformers or TRL, TRL's never load posttrain), so the whole-process peak is what a job of that
side needs. Speed and memory come from separate runs: speed from `--rounds` runs per side under
glibc's default allocator (as a job runs), memory from one run per side with the allocator's
mmap threshold pinned (`benchmarks/_memory.py`: the resident set then follows live tensors, but
every large tensor costs page faults, so those runs are slow). The runs alternate, posttrain
then TRL, so a change of machine load hits both sides alike. The ratios printed at the end come
from this one invocation. Targets (issue 12, the native side): SFT useful tokens/s >= 1.5x TRL (padded and
packed), peak memory <= 0.7x TRL, DPO and GRPO steps/s >= 1.0x TRL. The transformers backend's ratios to
TRL and to the native side are printed beside them, with no target.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers_common import BENCHMARKS, WORKLOADS, Documents, Settings, build_model_folder, model_config  # noqa: E402

from _memory import peak_memory  # noqa: E402

SIDES = ("posttrain", "posttrain-hf", "trl")
MODEL_BACKENDS = {"posttrain": "native", "posttrain-hf": "transformers"}  # posttrain's sides: their model.backend
TARGETS = {"tokens_per_s": 1.5, "steps_per_s": 1.0, "memory": 0.7}
LIBRARIES = ("posttrain", "transformers", "trl", "accelerate", "datasets")  # reported per run: what its process loaded


def setup_job(side: str, workload: str, folder: Path, s: Settings, threads: int,
              documents: Documents | None = None) -> dict[str, Any]:
    """Build one side's trainer state for `workload` (in the measuring child, not timed); SFT may get its documents."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(s.seed)
    module = _side_module(side)
    backend = {"backend": MODEL_BACKENDS[side]} if side in MODEL_BACKENDS else {}
    if workload.startswith("sft_"):
        state = module.setup_sft(folder, s, packed=workload == "sft_packed", documents=documents, **backend)
    else:
        state = getattr(module, f"setup_{workload}")(folder, s, **backend)
    return {**state, "side": side}


def run_job(state: dict[str, Any]) -> dict[str, Any]:
    """The warm-up and timed steps (measured for peak memory), and which of `LIBRARIES` the process holds."""
    result = _side_module(state["side"]).run(state)
    return {**result, "libraries": [name for name in LIBRARIES if name in sys.modules]}


def _side_module(side: str):
    return importlib.import_module("peers_ours" if side in MODEL_BACKENDS else "peers_trl")


def parse_workloads(text: str) -> list[str]:
    names: list[str] = []
    for name in text.split(","):
        expanded = ["sft_padded", "sft_packed"] if name == "sft" else [name]
        for n in expanded:
            if n not in WORKLOADS:
                raise SystemExit(f"--workloads: unknown workload {n!r}; choose from sft, {', '.join(WORKLOADS)}")
            names.append(n)
    return list(dict.fromkeys(names))


def environment(threads: int) -> dict[str, Any]:
    import accelerate
    import torch
    import transformers
    import trl

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCHMARKS, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu, "cores": os.cpu_count(),
        "torch_threads": threads, "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "trl": trl.__version__, "accelerate": accelerate.__version__,
        "commit": commit,
    }


def summarize(workload: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per side: tokens/s and steps/s over all speed runs' timed windows, the worst peak of its memory
    runs, the final loss of its first speed run."""
    out: dict[str, Any] = {"workload": workload}
    for side in SIDES:
        timed = [r for r in runs if r["side"] == side and r["measures"] == "speed"]
        sized = [r for r in runs if r["side"] == side and r["measures"] == "memory"]
        seconds = sum(r["seconds"] for r in timed)
        out[side] = {
            "tokens_per_s": sum(r["useful_tokens"] for r in timed) / seconds,
            "steps_per_s": sum(r["steps"] for r in timed) / seconds,
            "peak_total_mib": max(r["peak_total_mib"] for r in sized),
            "peak_step_mib": max(r["peak_step_mib"] for r in sized),
            "final_loss": timed[0]["losses"][-1],
        }
    out["ratios"] = _ratios(out["posttrain"], out["trl"])
    out["fallback"] = {"vs_trl": _ratios(out["posttrain-hf"], out["trl"]),  # the transformers backend
                       "vs_native": _ratios(out["posttrain-hf"], out["posttrain"])}
    speed_key = "tokens_per_s" if workload.startswith("sft") else "steps_per_s"
    out["targets"] = {
        speed_key: out["ratios"][speed_key] >= TARGETS[speed_key],
        "memory (process)": out["ratios"]["peak_total"] <= TARGETS["memory"],
        "memory (training)": out["ratios"]["peak_step"] <= TARGETS["memory"],
    }
    return out


def _ratios(ours: dict[str, float], theirs: dict[str, float]) -> dict[str, float]:
    return {"tokens_per_s": ours["tokens_per_s"] / theirs["tokens_per_s"],
            "steps_per_s": ours["steps_per_s"] / theirs["steps_per_s"],
            "peak_total": ours["peak_total_mib"] / theirs["peak_total_mib"],
            "peak_step": ours["peak_step_mib"] / theirs["peak_step_mib"]}


def print_table(summaries: list[dict[str, Any]]) -> None:
    head = (f"{'workload':11} {'side':12} {'useful tok/s':>12} {'steps/s':>8} {'peak MiB':>9} {'step MiB':>9} "
            f"{'final loss':>11}")
    print(head)
    for row in summaries:
        for side in SIDES:
            r = row[side]
            print(f"{row['workload']:11} {side:12} {r['tokens_per_s']:12.1f} {r['steps_per_s']:8.3f} "
                  f"{r['peak_total_mib']:9.0f} {r['peak_step_mib']:9.0f} {r['final_loss']:11.5g}")
    print("\nposttrain / TRL (this run)")
    print(f"{'workload':11} {'tok/s':>7} {'steps/s':>8} {'peak':>6} {'step peak':>10}  targets")
    for row in summaries:
        q = row["ratios"]
        verdict = ", ".join(f"{k} {'met' if ok else 'MISSED'}" for k, ok in row["targets"].items())
        print(f"{row['workload']:11} {q['tokens_per_s']:7.2f} {q['steps_per_s']:8.2f} {q['peak_total']:6.2f} "
              f"{q['peak_step']:10.2f}  {verdict}")
    print("\nthe transformers backend (posttrain-hf) / TRL, and / posttrain native (this run; no target)")
    print(f"{'workload':11} {'vs':7} {'tok/s':>7} {'steps/s':>8} {'peak':>6} {'step peak':>10}")
    for row in summaries:
        for against, q in (("TRL", row["fallback"]["vs_trl"]), ("native", row["fallback"]["vs_native"])):
            print(f"{row['workload']:11} {against:7} {q['tokens_per_s']:7.2f} {q['steps_per_s']:8.2f} "
                  f"{q['peak_total']:6.2f} {q['peak_step']:10.2f}")
    print(f"targets: SFT useful tokens/s >= {TARGETS['tokens_per_s']}x, DPO/GRPO steps/s >= "
          f"{TARGETS['steps_per_s']}x, peak memory <= {TARGETS['memory']}x: of the whole process (peak MiB: "
          "libraries, model, data, training) and of training alone (step MiB: the peak above the state after setup)")


LABELS = {"sft_padded": "SFT padded", "sft_packed": "SFT packed", "dpo": "DPO", "grpo": "GRPO"}


def markdown_tables(result: dict[str, Any]) -> str:
    """The docs' tables of one run (its peers.json): every side's numbers, then the ratios, so none is typed."""
    lines = ["| workload | side | useful tok/s | steps/s | peak MiB (process) | peak MiB (training) | final loss |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for row in result["summary"]:
        for i, side in enumerate(SIDES):
            r = row[side]
            lines.append(f"| {LABELS[row['workload']] if i == 0 else ''} | {side} | {r['tokens_per_s']:,.1f} | "
                         f"{r['steps_per_s']:.3f} | {r['peak_total_mib']:,.0f} | {r['peak_step_mib']:,.0f} | "
                         f"{r['final_loss']:.5g} |")
    lines += ["", "| workload | ratio | useful tok/s | steps/s | peak (process) | peak (training) |", "|---|---|---:|---:|---:|---:|"]
    for row in result["summary"]:
        pairs = (("posttrain / TRL", row["ratios"]), ("posttrain-hf / TRL", row["fallback"]["vs_trl"]),
                 ("posttrain-hf / posttrain", row["fallback"]["vs_native"]))
        for i, (name, q) in enumerate(pairs):
            lines.append(f"| {LABELS[row['workload']] if i == 0 else ''} | {name} | {q['tokens_per_s']:.2f} | "
                         f"{q['steps_per_s']:.2f} | {q['peak_total']:.2f} | {q['peak_step']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="sft,dpo,grpo", help="comma-separated: sft, sft_padded, sft_packed, dpo, grpo")
    parser.add_argument("--steps", type=int, default=Settings.steps, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=Settings.warmup, help="untimed steps before them (>= 1)")
    parser.add_argument("--rounds", type=int, default=1, help="speed runs per side and workload (the sides in turn)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per run (0: torch's default); 1 avoids OpenMP spin contention on a loaded machine")
    parser.add_argument("--seq", type=int, default=Settings.seq)
    parser.add_argument("--vocab", type=int, default=Settings.vocab)
    parser.add_argument("--hidden", type=int, default=Settings.hidden)
    parser.add_argument("--layers", type=int, default=Settings.layers)
    parser.add_argument("--json", type=Path, default=BENCHMARKS.parent / "results" / "benchmarks" / "peers.json",
                        help="where to write settings, environment, every run and the ratios")
    parser.add_argument("--table", type=Path, help="print the markdown tables of a saved run (its --json) and exit")
    args = parser.parse_args(argv)
    if args.table:
        result = json.loads(args.table.read_text())
        print(markdown_tables(result))
        return result
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--warmup, --steps and --rounds must be >= 1 (the first step holds lazy initializations)")
    workloads = parse_workloads(args.workloads)
    s = Settings(steps=args.steps, warmup=args.warmup, seq=args.seq, vocab=args.vocab, hidden=args.hidden,
                 layers=args.layers)

    env = environment(args.threads)
    env["load_average_start"] = os.getloadavg()
    print(f"{env['date']}  {env['cpu']} ({env['cores']} cores), load {env['load_average_start'][0]:.1f}, "
          f"torch {env['torch']}, transformers {env['transformers']}, trl {env['trl']}, {args.threads} thread(s)")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="peers-") as work:
        folder = build_model_folder(model_config(s), Path(work) / "model", seed=s.seed)
        for workload in workloads:
            for side in SIDES:
                m = peak_memory(setup_job, run_job, side, workload, folder, s, args.threads, device="cpu")
                row = {"workload": workload, "side": side, "measures": "memory", **m.result,
                       "peak_step_mib": m.peak_mib, "peak_total_mib": m.baseline_mib + m.peak_mib,
                       "setup_mib": m.baseline_mib}
                runs.append(row)
                print(f"  {workload:11} {side:12} memory: peak {row['peak_total_mib']:6.0f} MiB (after setup "
                      f"{row['setup_mib']:4.0f}), loss {row['losses'][-1]:.5g}", flush=True)
            for round_ in range(args.rounds):
                for side in SIDES:
                    r = peak_memory(setup_job, run_job, side, workload, folder, s, args.threads, device="cpu",
                                    pin_allocator=False).result
                    runs.append({"workload": workload, "side": side, "measures": "speed", "round": round_, **r})
                    print(f"  {workload:11} {side:12} speed, round {round_ + 1}: {r['useful_tokens'] / r['seconds']:8.1f} "
                          f"useful tok/s, {r['seconds'] / r['steps']:6.2f} s/step, loss {r['losses'][-1]:.5g}", flush=True)
    env["load_average_end"] = os.getloadavg()
    summaries = [summarize(w, [r for r in runs if r["workload"] == w]) for w in workloads]
    print()
    print_table(summaries)
    result = {"settings": s.as_dict(), "rounds": args.rounds, "environment": env, "runs": runs, "summary": summaries}
    write_json(args.json, result)
    print(f"wrote {args.json}; its tables for the docs: python benchmarks/peers/run.py --table {args.json}")
    return result


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    main()
