"""LoRA against full fine-tuning on the same pipeline: each model stage's wall time and output size, and the
held-out accuracy of its evaluation, from two finished one-variant runs (their `variants/default/manifest.json`,
each stage's `posttrain.json`, each eval's `metrics.json`), as one markdown table with the ratios.

    python benchmarks/lora/compare.py results/smoke-full results/smoke-lora
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

MODEL_STAGES = ("sft", "dpo", "grpo", "distill")


def _stage(manifest: dict[str, Any], stage: str) -> dict[str, Any]:
    folder = Path(manifest["stages"][stage]["path"])  # relative to where snakemake ran: run this there
    record = json.loads((folder / "posttrain.json").read_text())
    weights = sum(f.stat().st_size for f in folder.rglob("*.safetensors"))
    evaluation = json.loads((Path(manifest["eval"][stage]["path"]) / "metrics.json").read_text())
    return {"wall_s": record["wall_time_s"], "weights_mb": weights / 2**20, "accuracy": evaluation["accuracy"],
            "method": record["config"][stage]["method"], "save": record["config"][stage]["save"]}


def rows(full: Path, lora: Path) -> list[dict[str, Any]]:
    manifests = [json.loads((r / "variants" / "default" / "manifest.json").read_text()) for r in (full, lora)]
    out = []
    for stage in MODEL_STAGES:
        if stage in manifests[0]["stages"] and stage in manifests[1]["stages"]:
            a, b = (_stage(m, stage) for m in manifests)
            out.append({"stage": stage, "full": a, "lora": b})
    return out


def markdown(table: list[dict[str, Any]]) -> str:
    lines = ["| stage | LoRA save | wall s full | wall s LoRA | ratio | weight files MB full | MB LoRA | ratio "
             "| accuracy full | accuracy LoRA |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        a, b = r["full"], r["lora"]
        lines.append(f"| {r['stage']} | {b['save']} | {a['wall_s']:.1f} | {b['wall_s']:.1f} | {b['wall_s'] / a['wall_s']:.2f} "
                     f"| {a['weights_mb']:.2f} | {b['weights_mb']:.2f} | {b['weights_mb'] / a['weights_mb']:.3f} "
                     f"| {a['accuracy']:.3f} | {b['accuracy']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("full", type=Path)
    parser.add_argument("lora", type=Path)
    args = parser.parse_args()
    print(markdown(rows(args.full, args.lora)))


if __name__ == "__main__":
    main()
