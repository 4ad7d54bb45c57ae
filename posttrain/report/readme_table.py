"""The README's results table, generated from a report directory rather than typed.

    python -m posttrain.report.readme_table results/report [--update README.md]

Prints a markdown table from `summary.tsv`: one row per stage in pipeline order (one per variant
group where the groups' models differ), greedy accuracy, pass@k, NLL, preference accuracy and the
change from the stage the model started from; a group with several seeds shows mean ± std (sample
std). A line under it names the machine (`machine.json`: CPU model, ISA flags), the threads, the
date, the commit and this command, since float rounding and so the numbers depend on them.
`--update FILE` replaces what lies between the markers `<!-- results:begin -->` and
`<!-- results:end -->` in FILE with the table and that line (`--block NAME`: `<!-- NAME:begin -->`,
for a second table in one file). `--times` adds the minutes each stage took (`stage_times.tsv`);
`--per-seed` adds each seed's greedy accuracy and pass@1 with their change, since a mean over seeds
can hide a seed where a stage did harm.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from posttrain.report.effects import effect_metrics, effects_table, model_changes
from posttrain.report.stage_times import markdown_times
from posttrain.report.summary import read_summary
from posttrain.utils.io import read_json
from posttrain.workflow.layout import pipeline_order

BLOCK = "results"
LABELS = {"accuracy": "greedy accuracy", "nll": "NLL"}
CHANGE = "change from previous stage"
SEED_METRICS = ("accuracy", "pass@1")


def table_metrics(summary: pd.DataFrame) -> list[str]:
    """The report's eval metrics but `reward`, which repeats greedy accuracy under the task verifier."""
    return [m for m in effect_metrics(summary.columns) if m != "reward"]


def _value(mean: float, std: float, n: int, signed: bool = False) -> str:
    if math.isnan(mean):
        return "–"
    text = f"{mean:+.3f}" if signed else f"{mean:.3f}"
    return f"{text} ± {std:.3f}" if n > 1 and not math.isnan(std) else text


def _row_groups(summary: pd.DataFrame) -> list[tuple[str, str]]:
    """(stage, group) rows in pipeline order; a group whose models at a stage are another group's
    (same eval keys: a shared prefix of the pipeline) is that row, not a second one."""
    models = summary.groupby(["stage", "group"], sort=False)["eval_key"].agg(frozenset)
    groups = list(dict.fromkeys(summary["group"]))
    rows = []
    for stage in pipeline_order(set(summary["stage"])):
        seen: set[frozenset] = set()
        for group in groups:
            if (stage, group) in models.index and models[(stage, group)] not in seen:
                seen.add(models[(stage, group)])
                rows.append((stage, group))
    return rows


def _labelled_rows(summary: pd.DataFrame) -> list[tuple[str, str, str]]:
    """`_row_groups` with each row's label: the stage, and the group where the stage has several rows."""
    rows = _row_groups(summary)
    per_stage = pd.Series([stage for stage, _ in rows]).value_counts()
    return [(stage, group, (stage if per_stage[stage] == 1 else f"{stage}, {group}").replace("|", "\\|"))
            for stage, group in rows]


def _label(metric: str) -> str:
    return LABELS.get(metric, metric)


def markdown_table(summary: pd.DataFrame) -> str:
    """The table (markdown, pipe format) of a summary table."""
    metrics = table_metrics(summary)
    effects = effects_table(summary).set_index(["stage", "group", "metric"])
    lines = []
    for stage, group, label in _labelled_rows(summary):
        line = {"stage": label}
        changes = []
        for metric in metrics:
            e = effects.loc[(stage, group, metric)] if (stage, group, metric) in effects.index else None
            line[_label(metric)] = "–" if e is None else _value(e["mean"], e["std"], e["n"])
            if e is not None and not math.isnan(e["delta_mean"]):
                changes.append(f"{_label(metric)} {_value(e['delta_mean'], e['delta_std'], e['n'], signed=True)}")
        line[CHANGE] = "; ".join(changes) or "–"
        lines.append(line)
    table = pd.DataFrame(lines)
    align = ["left", *["right"] * len(metrics), "left"]
    return table.to_markdown(index=False, tablefmt="pipe", colalign=align, disable_numparse=True)


def _change(delta: float) -> str:
    return "" if math.isnan(delta) else f" ({delta:+.3f})"


def seed_table(summary: pd.DataFrame) -> str:
    """Each seed's value and change of greedy accuracy and pass@1, one column per seed, the rows of
    `markdown_table`."""
    metrics = [m for m in SEED_METRICS if m in summary.columns]
    models = model_changes(summary).reset_index()
    models = models[models["metric"].isin(metrics) & models["seed"].notna()]
    seeds = sorted({int(s) for s in models["seed"]})
    lines = []
    for stage, group, label in _labelled_rows(summary):
        line = {"stage": label}
        here = models[(models["stage"] == stage) & (models["group"] == group) & models["value"].notna()]
        found = {(int(r.seed), r.metric): (r.value, r.delta) for r in here.itertuples()}
        for seed in seeds:
            cells = [f"{_label(m)} {found[(seed, m)][0]:.3f}" + _change(found[(seed, m)][1])
                     for m in metrics if (seed, m) in found]
            line[f"seed {seed}"] = "; ".join(cells) or "–"
        lines.append(line)
    table = pd.DataFrame(lines)
    return table.to_markdown(index=False, tablefmt="pipe", disable_numparse=True)


def _flags(isa: Mapping[str, bool]) -> str:
    present = ", ".join(f for f, on in isa.items() if on) or "none"
    absent = ", ".join(f for f, on in isa.items() if not on)
    return f"{present}; no {absent}" if absent else present


def _threads(machine: Mapping[str, Any]) -> str:
    values = sorted({t for by_key in machine["stage_threads"].values() for t in by_key.values() if t is not None})
    stages = f"stages ran with {', '.join(map(str, values))} torch thread(s)" if values else "stage threads not recorded"
    return f"{stages} (report: {machine['report_torch_threads']})"


def provenance_line(summary: pd.DataFrame, machine: Mapping[str, Any], command: str) -> str:
    """What made the numbers: seeds, machine, threads, date, commit, command."""
    seeds = ", ".join(str(s) for s in sorted({int(s) for s in summary["seed"].dropna()})) or "not recorded"
    replicated = summary.groupby("group")["seed"].nunique().max() > 1
    spread = "mean ± std (sample std) over the seeds of each variant group, " if replicated else ""
    return f"*{spread}seeds {seeds}; {machine_description(machine)}; made by `{command}`.*"


def machine_description(machine: Mapping[str, Any]) -> str:
    """CPU model and ISA flags, CPUs, threads, date, commit and torch of a run (its `machine.json`)."""
    sha, dirty, _ = (machine["git_commit"] or "unknown").partition("-dirty")
    return (f"{machine['cpu_model']} ({machine['arch']}, {_flags(machine['isa'])}), {machine['cpus_usable']} CPUs, "
            f"{_threads(machine)}; report of {machine['date']}, commit {sha[:12]}{dirty}, torch {machine['torch']}")


def read_machine(path: Path) -> dict[str, Any]:
    return read_json(path, "rerun the report stage (it writes machine.json)")


def markers(name: str = BLOCK) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_block(text: str, block: str, where: str, name: str = BLOCK) -> str:
    """`text` with what lies between the `name` block's begin and end markers replaced by `block`."""
    first, last = markers(name)
    begin, end = text.find(first), text.find(last)
    if begin < 0 or end < 0 or end < begin:
        raise ValueError(f"{where}: needs the markers {first} and {last}, in that order, around the results table")
    return f"{text[:begin + len(first)]}\n{block}\n{text[end:]}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", type=Path, help="the report stage's directory (results/report)")
    parser.add_argument("--update", type=Path, metavar="FILE", help="write the table between FILE's results markers")
    parser.add_argument("--block", default=BLOCK, metavar="NAME", help="the markers' name (default: %(default)s)")
    parser.add_argument("--times", action="store_true", help="add each stage's wall time (stage_times.tsv)")
    parser.add_argument("--per-seed", action="store_true",
                        help="add each seed's greedy accuracy and pass@1 with their change from the previous stage")
    args = parser.parse_args(argv)
    words = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "-m", "posttrain.report.readme_table", *words])
    summary = read_summary(args.report / "summary.tsv")
    machine = read_machine(args.report / "machine.json")
    block = markdown_table(summary)
    if args.per_seed:
        block += f"\n\nPer seed (value, change from the previous stage in brackets):\n\n{seed_table(summary)}"
    if args.times:
        times = pd.read_csv(args.report / "stage_times.tsv", sep="\t", dtype={"key": str, "variants": str})
        groups = dict(zip(summary["variant"], summary["group"]))
        block += f"\n\nWall time (minutes; several outputs: mean ± std):\n\n{markdown_times(times, groups)}"
    block += f"\n\n{provenance_line(summary, machine, command)}"
    print(block)
    if args.update:
        try:
            text = args.update.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise SystemExit(f"--update {args.update}: no such file") from None
        try:
            args.update.write_text(replace_block(text, block, str(args.update), args.block), encoding="utf-8")
        except ValueError as err:
            raise SystemExit(str(err)) from None


if __name__ == "__main__":
    main()
