"""report: tables and figures over every variant's stages and evaluations, stages in pipeline order.

    python stages/report.py --config results/report.config.json --out results/report

The config is the workflow's report config: `{"stage": "report", "key", "upstream", "code",
"variants": {name: manifest}}` (`READS`: the variants), each manifest naming the variant's stage
outputs (`stages: {stage: {key, path}}`), its evaluations (`eval: {stage: {key, path}}`), the model
stage each model started from (`previous: {stage: stage or null}`) and `overrides`. Output (written
to a temporary sibling and renamed when complete):

    summary.tsv           one row per variant and evaluated stage (columns: posttrain.report.summary)
    effects.tsv           per seed group, stage and metric: mean, spread, change from the previous
                          stage (columns: posttrain.report.effects)
    objective_curves.png  each stage's objective keys against step (posttrain.report.curves)
    eval_metrics.png      accuracy, pass@k, reward, NLL, preference accuracy by stage and variant
    stage_effects.png     effects.tsv drawn: value and change per stage, error bars over seeds
    stage_times.tsv       wall time of every stage output and evaluation (posttrain.report.stage_times)
    machine.json          CPU, ISA flags, threads, commit, date (posttrain.report.machine)
    posttrain.json        provenance

Captions for Snakemake's HTML report: workflow/report/*.rst.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from posttrain.training.faults import run_main
from posttrain.report.curves import objective_curves
from posttrain.report.effects import effect_metrics, effects_table
from posttrain.report.machine import machine_info
from posttrain.report.plots import plot_eval_metrics, plot_objective_curves, plot_stage_effects
from posttrain.report.inputs import read_report_config, stage_runs
from posttrain.report.stage_times import stage_time_table
from posttrain.report.summary import summary_rows, summary_table
from posttrain.stage_config import parse_inputs
from posttrain.utils.provenance import write_stage_output

STAGE = "report"
READS = ("variants",)
INPUTS = {}  # its config names every input (the variants' stage and eval folders)


def main() -> None:
    args = parse_inputs(STAGE, INPUTS)
    started = time.time()
    cfg = read_report_config(args.config, READS, __file__)

    rows = summary_rows(cfg["variants"])
    table = summary_table(rows)
    effects = effects_table(table)
    metrics = effect_metrics(table.columns)
    curves = objective_curves(stage_runs(cfg["variants"]))

    def write(out: Path) -> dict[str, Any]:
        table.to_csv(out / "summary.tsv", sep="\t", index=False, na_rep="", float_format="%.6g")
        effects.to_csv(out / "effects.tsv", sep="\t", index=False, na_rep="", float_format="%.6g")
        stage_time_table(cfg["variants"]).to_csv(out / "stage_times.tsv", sep="\t", index=False, na_rep="")
        plot_objective_curves(curves, out / "objective_curves.png")
        plot_eval_metrics(rows, metrics, out / "eval_metrics.png")
        plot_stage_effects(effects, metrics, out / "stage_effects.png")
        (out / "machine.json").write_text(json.dumps(machine_info(cfg["variants"]), indent=2) + "\n", encoding="utf-8")
        return {"rows": len(rows), "variants": len(cfg["variants"])}

    write_stage_output(args.out, cfg, STAGE, started, write)
    print(json.dumps({"out": args.out, "rows": len(rows), "variants": len(cfg["variants"])}))


if __name__ == "__main__":
    run_main(STAGE, main)
