"""What each planned training stage will do, as the dry run prints it: steps, rows and tokens per step, the split it
trains on and the epochs over it.

Rows are counted as data prep will count them where the config and the local files tell (generated tasks'
`data.n_*`, every row of a local source, the SFT rows `sft_eval` holds out); a hub source, a file over the dry
run's read limit, KTO's unpaired split and packed SFT rows are known only once data prep has run, and are shown
so. Tokens per step are upper bounds (every row at `data.max_seq_len`, every completion at `max_new_tokens`).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.report.readme_table import replace_block
from posttrain.utils.io import PROVENANCE_FILE
from posttrain.workflow.plan import Plan, build_plan
from posttrain.workflow.schema import REPO_ROOT, load_config

TRAINING_STAGES = ("sft", "dpo", "reward_model", "grpo", "distill")
COLUMNS = ("stage", "key", "variants", "steps", "per step", "tokens/step", "trains on", "epochs")


def kind_rows(data: Mapping[str, Any], kind: str, prepared: Mapping[str, int] | None = None) -> int | None:
    """Rows of `kind` data prep will gather: generated tasks' `n_<kind>` plus every source of that kind (None: a
    source whose rows only data prep can count); `prepared`: the rows data prep wrote, by split, once it has run."""
    from posttrain.workflow.preflight import local_source_rows

    if prepared is not None and kind in prepared:
        return prepared[kind]
    total = int(data[f"n_{kind}"]) if data["tasks"] and f"n_{kind}" in data else 0
    for i, source in enumerate(data["sources"]):
        if source["kind"] == kind:
            rows = local_source_rows(data, i)
            if rows is None:
                return None
            total += rows
    return total


def _training_split(stage: str, section: Mapping[str, Any], data: Mapping[str, Any], reward_prompts: int | None,
                    prepared: Mapping[str, int] | None,
                    scored: Mapping[str, Any] | None = None) -> tuple[int | None, str, str]:
    """(rows, what a row is, note) of the split the stage steps through; `reward_prompts`: the `reward.n_prompts`
    of the reward stage it reads (GRPO's prompts, DPO's on-policy pairs), None without one; `scored`: that
    reward stage's metrics once it has run (the pairs and band prompts it wrote)."""
    if stage in ("sft", "distill") and not (stage == "distill" and section["data"] != "sft"):
        if prepared is not None:
            return prepared["sft"], "sft rows", "as prepared"
        docs = kind_rows(data, "sft")
        if docs is not None:
            docs -= min(int(data["n_eval"]), docs // 10)  # sft_eval's share
        if data["packing"]:
            return None, "sft rows", f"{docs if docs is not None else '?'} documents, packed"
        return docs, "sft rows", ""
    if stage == "distill":
        return kind_rows(data, "prompts", prepared), "prompts", "completions sampled"
    if stage == "dpo":
        if section["pairs"] == "on_policy":
            if scored is not None:
                return int(scored["pairs"]), "pairs", "on-policy, as scored"
            return None, "pairs", f"on-policy, <= {reward_prompts} from the reward stage"
        if section["loss"] == "kto":
            return (prepared["unpaired"], "unpaired rows", "") if prepared else (None, "unpaired rows", "counted by data prep")
        return kind_rows(data, "preference", prepared), "pairs", ""
    if stage == "reward_model":
        pairs = kind_rows(data, "preference", prepared)
        if pairs is None:
            return None, "pairs", ""
        held = max(1, int(pairs * float(section["held_out"])))
        return pairs - held, "pairs", f"{held} held out"
    if scored is not None:
        return int(scored["grpo_prompts"]), "prompts", "the reward stage's band, as scored"
    prompts = kind_rows(data, "prompts", prepared)
    if reward_prompts is not None and prompts is not None:
        prompts = min(prompts, reward_prompts)
        return prompts, "prompts", "at most: the reward stage's band may drop some"
    return prompts, "prompts", ""


def _per_step(stage: str, section: Mapping[str, Any], max_len: int) -> tuple[int, int]:
    """(rows per optimizer step, upper bound on the tokens of one step)."""
    if stage == "grpo":
        prompts = int(section["prompts_per_step"])
        return prompts, prompts * int(section["group_size"]) * (max_len + int(section["max_new_tokens"]))
    rows = int(section["batch_size"])
    return rows, rows * max_len * (2 if stage in ("dpo", "reward_model") else 1)


def stage_row(stage: str, section: Mapping[str, Any], data: Mapping[str, Any], reward_prompts: int | None = None,
              prepared: Mapping[str, int] | None = None, scored: Mapping[str, Any] | None = None) -> dict[str, str]:
    """One training stage's line of the summary (strings by column)."""
    rows, unit, note = _training_split(stage, section, data, reward_prompts, prepared, scored)
    per_step, tokens = _per_step(stage, section, int(data["max_seq_len"]))
    epochs = section.get("epochs")
    if epochs is None:
        steps = str(section["steps"])
        over = f"{int(section['steps']) * per_step / rows:.2f}" if rows else (
            "after reward scoring" if unit == "pairs" and section.get("pairs") == "on_policy" else "after data prep")
    else:
        steps = str(max(1, math.ceil(float(epochs) * rows / per_step))) if rows else "from epochs"
        over = f"{float(epochs):g}"
    trains_on = note if rows is None and note else f"{rows if rows is not None else '?'} {unit}" + (f" ({note})" if note else "")
    return {"stage": stage, "steps": steps, "per step": f"{per_step} {unit}", "tokens/step": f"<= {tokens:,}",
            "trains on": trains_on, "epochs": over}


def prepared_rows(data_dir: Path) -> dict[str, int] | None:
    """Rows per split of a data prep output that exists (its stats.json), else None."""
    stats = data_dir / "stats.json"
    if not stats.is_file():
        return None
    return {split: int(values["rows"]) for split, values in json.loads(stats.read_text())["splits"].items()}


def scored_counts(reward_dir: Path) -> dict[str, Any] | None:
    """The metrics of a reward scoring output that exists (its posttrain.json: `pairs`, `grpo_prompts`), else None."""
    record = reward_dir / PROVENANCE_FILE
    if not record.is_file():
        return None
    metrics = json.loads(record.read_text()).get("metrics", {})
    return metrics if {"pairs", "grpo_prompts"} <= metrics.keys() else None


def summary_lines(plan: Plan, columns: Sequence[str] = COLUMNS, read_prepared: bool = True) -> list[str]:
    """The table of every planned training job (one line per stage key, with the variants that share it);
    `read_prepared`: count a split from its data prep output where that exists already."""
    rows: dict[tuple[str, str], dict[str, str]] = {}
    names: dict[tuple[str, str], list[str]] = {}
    for variant in plan.variants.values():
        data_job = variant.stages["prepare_data"]
        data = data_job.resolved.get("data")
        if data is None:  # a data stage that reads no data section (the workflow tests' stand-in stages)
            continue
        prepared = prepared_rows(Path(data_job.path)) if read_prepared else None
        for stage, job in variant.stages.items():
            if stage not in TRAINING_STAGES or stage not in job.resolved:
                continue
            names.setdefault((stage, job.key), []).append(variant.name)
            if (stage, job.key) not in rows:
                reward = job.inputs.get("reward") or job.inputs.get("pairs")
                prompts = reward.resolved.get("reward", {}).get("n_prompts") if reward is not None else None
                scored = scored_counts(Path(reward.path)) if reward is not None and read_prepared else None
                rows[(stage, job.key)] = {**stage_row(stage, job.resolved[stage], data, prompts, prepared, scored),
                                          "key": job.key}
    if not rows:
        return []
    for id_, row in rows.items():
        shared = names[id_]
        row["variants"] = ", ".join(shared[:3]) + (f" +{len(shared) - 3}" if len(shared) > 3 else "")
    table = [dict(zip(columns, columns)), *rows.values()]
    widths = {c: max(len(r[c]) for r in table) for c in columns}
    lines = ["training stages (rows as data prep will count them; tokens per step at most):"]
    lines += ["  " + "  ".join(r[c].ljust(widths[c]) for c in columns).rstrip() for r in table]
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """The table for config/config.yaml (and --configfile overlays) from the config alone, without the keys, which
    move with the code;
    `--update FILE --block NAME` writes it between FILE's markers, as the dry run prints it."""
    parser = argparse.ArgumentParser(prog="python -m posttrain.workflow.stage_summary", description=main.__doc__)
    parser.add_argument("--configfile", nargs="*", default=[], help="overlays, as snakemake --configfile")
    parser.add_argument("--update", type=Path, help="a markdown file with the block's markers")
    parser.add_argument("--block", default="dry-run")
    args = parser.parse_args(argv)
    cfg = load_config(REPO_ROOT / "config" / "config.yaml", *map(Path, args.configfile))
    if cfg["ablations"]:
        cfg["ablations"] = str(REPO_ROOT / cfg["ablations"])
    lines = summary_lines(build_plan(cfg), [c for c in COLUMNS if c != "key"], read_prepared=False)
    command = shlex.join(["python", "-m", "posttrain.workflow.stage_summary", *sys.argv[1:]] if argv is None
                         else ["python", "-m", "posttrain.workflow.stage_summary", *argv])
    text = "\n".join(["```", *lines, "```", f"*made by `{command}` (what `snakemake -n` prints, with the stage keys)*"])
    if args.update is None:
        print(text)
        return
    args.update.write_text(replace_block(args.update.read_text(), text, str(args.update), args.block))


if __name__ == "__main__":
    main()
