"""Where a run's time went: the wall time of every stage output and evaluation a report covers.

Columns of `stage_times.tsv`, one row per distinct output (variants that share it are listed once):

    stage          a pipeline stage, `dpo_pairs` for the reward scoring that samples on-policy DPO's pairs, or
                   `eval <model stage>` for an evaluation (`eval base`: stage zero)
    key            the output's key
    variants       the variants that use it, comma-joined
    wall_time_s    the stage process's wall time from start to its output (its posttrain.json)

The process's own clock: interpreter start-up and imports (seconds) are Snakemake's to add
(`<results>/benchmarks/`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from posttrain.workflow.layout import ORDER
from posttrain.workflow.roles import DPO_PAIRS
from posttrain.workflow.lineage import read_provenance

COLUMNS = ("stage", "key", "variants", "wall_time_s")
EVAL_PREFIX = "eval "


def _order(stage: str) -> tuple[int, int]:
    """Stages in pipeline order, each evaluation after the training stages in the order of what it evaluates."""
    if stage.startswith(EVAL_PREFIX):
        return ORDER.index("evaluate"), ORDER.index(stage[len(EVAL_PREFIX):])
    if stage == DPO_PAIRS:  # just before the dpo it feeds
        return ORDER.index("dpo"), -1
    return ORDER.index(stage), 0


def stage_time_table(variants: Mapping[str, Mapping[str, Any]]) -> pd.DataFrame:
    """The rows above from the report config's variant manifests (`stages` and `eval` refs)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for name, manifest in variants.items():
        outputs = [*manifest["stages"].items(), *((EVAL_PREFIX + s, ref) for s, ref in manifest["eval"].items())]
        for stage, ref in outputs:
            row = rows.get((stage, ref["key"]))
            if row is None:
                wall = read_provenance(ref["path"]).get("wall_time_s")
                row = rows[(stage, ref["key"])] = {"stage": stage, "key": ref["key"], "variants": [], "wall_time_s": wall}
            row["variants"].append(name)
    ordered = sorted(rows.values(), key=lambda r: _order(r["stage"]))
    return pd.DataFrame([{**r, "variants": ",".join(r["variants"])} for r in ordered], columns=COLUMNS)


def markdown_times(times: pd.DataFrame, groups: Mapping[str, str] | None = None) -> str:
    """Minutes per stage, mean ± std over its distinct outputs (one per seed), and the total per variant.

    With `groups` (variant -> variant group, as `summary.tsv` has them), a stage whose outputs are
    not shared across groups gets one row per group, `<stage>, <group>`, as in the results table.
    """
    minutes = times.assign(minutes=times["wall_time_s"] / 60)
    minutes["row"] = minutes["stage"]
    if groups:
        owners = minutes["variants"].str.split(",").map(lambda names: {groups.get(n, n) for n in names})
        for stage, outputs in owners.groupby(minutes["stage"], sort=False):
            if all(len(o) == 1 for o in outputs) and len(set().union(*outputs)) > 1:
                minutes.loc[outputs.index, "row"] = [f"{stage}, {next(iter(o))}" for o in outputs]
    per_stage = minutes.groupby("row", sort=False)["minutes"].agg(["mean", "std", "count"])
    per_variant = minutes.assign(variants=minutes["variants"].str.split(",")).explode("variants")
    totals = per_variant.groupby("variants")["minutes"].sum()
    lines = [{"stage": row, "outputs": int(r["count"]), "minutes": _minutes(r["mean"], r["std"], int(r["count"]))}
             for row, r in per_stage.iterrows()]
    lines.append({"stage": "total per variant", "outputs": len(totals),
                  "minutes": _minutes(totals.mean(), totals.std(), len(totals))})
    return pd.DataFrame(lines).to_markdown(index=False, tablefmt="pipe", colalign=["left", "right", "right"],
                                           disable_numparse=True)


def _minutes(mean: float, std: float, n: int) -> str:
    return f"{mean:.1f} ± {std:.1f}" if n > 1 else f"{mean:.1f}"
