"""Does every stage of the default recipe do what it is for, in every run? One table over runs.

    python benchmarks/quality/stage_effects.py results-1thread/report results-2threads/report

Each argument is a report directory of a finished sweep (e.g. `config/seeds.tsv`, one run per
thread count, since a change of threads changes float rounding as a change of CPU does). For every
variant of every report it prints the held-out metrics of each stage and checks the recipe's
claims (`CLAIMS`, thresholds stated there), then whether the runs of one seed at different thread
counts wrote bitwise-identical models. Exit status 1 when a claim fails in any run.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pandas as pd
from safetensors.torch import load_file

from posttrain.report.readme_table import machine_description, read_machine
from posttrain.report.summary import read_summary
from posttrain.utils.io import file_sha256
from posttrain.workflow.plan import MODEL_STAGES, STAGE_DIRS

Stages = Mapping[str, pd.Series]  # stage -> its summary row, for one variant

# What each stage is for, on the held-out eval split (README, "What each stage does there").
CLAIMS: dict[str, tuple[str, Callable[[Stages], bool]]] = {
    "sft": ("SFT learns the tasks: greedy accuracy >= 0.5 (0 before)", lambda s: s["sft"]["accuracy"] >= 0.5),
    "dpo": ("DPO: preference accuracy >= 0.75 (0.5 at its start), greedy accuracy within 0.05 of SFT's",
            lambda s: s["dpo"]["pref_acc"] >= 0.75 and s["dpo"]["accuracy"] >= s["sft"]["accuracy"] - 0.05),
    "grpo": ("GRPO raises pass@1, its sampled-reward objective, by >= 0.02",
             lambda s: s["grpo"]["pass@1"] - s["dpo"]["pass@1"] >= 0.02),
    "distill": ("the student reaches >= 0.9x its teacher's greedy accuracy",
                lambda s: s["distill"]["accuracy"] >= 0.9 * s[s["distill"]["previous"]]["accuracy"]),
}
COLUMNS = ("accuracy", "pass@1", "nll", "pref_acc")


def run_threads(machine: Mapping) -> str:
    """The torch threads the run's training stages used (one value, or a comma-joined list)."""
    values = sorted({t for stage in MODEL_STAGES for t in machine["stage_threads"].get(stage, {}).values() if t})
    return ",".join(map(str, values)) or "?"


def model_path(report: Path, stage: str, key: str) -> Path:
    return report.parent / STAGE_DIRS[stage] / key / "model.safetensors"


def sha256(path: Path) -> str:
    return file_sha256(path) if path.is_file() else "missing"


def max_abs_difference(paths: Sequence[Path]) -> float:
    """The largest elementwise difference between the first model's weights and any other's."""
    first, *others = (load_file(p) for p in paths)
    return max((first[name] - other[name]).abs().max().item() for other in others for name in first)


def runs(reports: Sequence[Path]) -> pd.DataFrame:
    """One row per (report, model stage, model): metrics, claim outcome, weights hash."""
    rows = []
    for report in reports:
        summary, threads = read_summary(report / "summary.tsv"), run_threads(read_machine(report / "machine.json"))
        for variant, table in summary.groupby("variant", sort=False):
            stages = {row["stage"]: row for _, row in table.iterrows()}
            for stage in (s for s in MODEL_STAGES if s in stages):
                row = stages[stage]
                holds = CLAIMS[stage][1](stages) if stage in CLAIMS else None
                rows.append({"threads": threads, "seed": int(row["seed"]), "variant": variant, "stage": stage,
                             **{c: row.get(c) for c in COLUMNS}, "claim": holds,
                             "key": row["key"], "weights": model_path(report, stage, row["key"])})
    # a model shared by variants (a common pipeline prefix) is one run, not one per variant
    table = pd.DataFrame(rows).drop_duplicates(["threads", "stage", "key"])
    return table.assign(sha=table["weights"].map(sha256))


def bitwise_lines(table: pd.DataFrame) -> list[str]:
    """Per stage: do the thread counts agree on every seed's weights, and by how much they differ if not."""
    if table["threads"].nunique() < 2:
        return ["one thread count only: no comparison of weights across thread counts"]
    lines = []
    for stage, runs_of_stage in table.groupby("stage", sort=False):
        models = runs_of_stage.groupby("variant", sort=False)
        if (runs_of_stage["sha"] == "missing").any():
            lines.append(f"{stage}: weights missing, not compared")
        elif (models["sha"].nunique() == 1).all():
            lines.append(f"{stage}: weights bitwise identical across thread counts in all {models.ngroups} variants")
        else:
            worst = max(max_abs_difference(list(group["weights"])) for _, group in models)
            lines.append(f"{stage}: weights differ across thread counts (largest elementwise difference {worst:.2g})")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="report directories (results/report) of finished sweeps")
    args = parser.parse_args(argv)
    table = runs(args.reports)
    shown = table.drop(columns=["key", "weights", "sha"])
    shown["claim"] = table["claim"].map({True: "holds", False: "FAILS", None: "–"})
    for column in COLUMNS:
        shown[column] = shown[column].map(lambda v: "–" if pd.isna(v) else f"{v:.3f}")
    align = ["right", "right", "left", "left", *["right"] * len(COLUMNS), "left"]
    print(shown.to_markdown(index=False, tablefmt="pipe", colalign=align, disable_numparse=True))
    print()
    for stage, (text, _) in CLAIMS.items():
        outcomes = table.loc[table["stage"] == stage, "claim"]
        print(f"- {stage}: {text}: holds in {int(outcomes.sum())} of {len(outcomes)} runs")
    print("".join(f"- {line}\n" for line in bitwise_lines(table)), end="")
    print("\nRuns:")
    for report in args.reports:
        print(f"- {report}: {machine_description(read_machine(report / 'machine.json'))}")
    print(f"\nMade by `{shlex.join(['python', 'benchmarks/quality/stage_effects.py', *map(str, args.reports)])}`.")
    return 0 if table["claim"].dropna().all() else 1


if __name__ == "__main__":
    sys.exit(main())
