"""What each stage changed: every eval metric per variant group and stage, with the change from the
stage before it, aggregated over seeds.

Variants that differ only in `seed` form a group (summary.tsv's `group`). A group's value of a
metric at a stage is the mean over its seeds, with the sample standard deviation (ddof=1; empty for
one seed), min and max. The change is taken per variant, the stage's value minus that of the stage
its model started from (summary.tsv's `previous`: dpo <- sft, grpo <- dpo, distill <- its teacher;
none for sft), then aggregated the same way. Variants of a group that share an evaluated model
(the same eval key) count once. Columns of `effects.tsv`, rows in pipeline order:

    group, stage, previous, metric
    n                     seeds (distinct evaluated models) with a value; metrics a stage lacks have no row
    mean, std, min, max   over those seeds
    delta_mean, delta_std the change from `previous`, over the same seeds (empty for sft)
    seeds, variants       comma-joined
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from posttrain.report.summary import pass_columns
from posttrain.workflow.layout import pipeline_order

EFFECT_METRICS = ("accuracy", "reward", "nll", "pref_acc")  # the pass@k columns go after accuracy
COLUMNS = ("group", "stage", "previous", "metric", "n", "mean", "std", "min", "max", "delta_mean", "delta_std",
           "seeds", "variants")


def effect_metrics(columns: Iterable[str]) -> list[str]:
    """The eval metrics among a summary table's columns, in report order."""
    names = list(columns)
    return [m for m in (EFFECT_METRICS[0], *pass_columns(names), *EFFECT_METRICS[1:]) if m in names]


def _seeds(values: pd.Series) -> str:
    return ",".join(str(seed) for seed in sorted({int(v) for v in values.dropna()}))


def model_changes(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per group, stage, evaluated model and metric: its seed, value and change from `previous`
    (indexed by group, stage, eval_key, metric), before any aggregation over seeds."""
    metrics = effect_metrics(summary.columns)
    table = summary.assign(**{m: pd.to_numeric(summary[m]) for m in metrics})
    long = table.melt(id_vars=["variant", "group", "seed", "stage", "previous", "eval_key"], value_vars=metrics,
                      var_name="metric")
    before = long[["variant", "stage", "metric", "value"]].rename(columns={"stage": "previous", "value": "before"})
    long = long.merge(before, on=["variant", "previous", "metric"], how="left")
    long["delta"] = long["value"] - long["before"]
    return long.groupby(["group", "stage", "eval_key", "metric"], sort=False).agg(
        previous=("previous", "first"), seed=("seed", "first"), value=("value", "first"), delta=("delta", "first"),
        variants=("variant", ",".join))


def effects_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The `effects.tsv` rows of a summary table (posttrain.report.summary's columns)."""
    metrics = effect_metrics(summary.columns)
    out = model_changes(summary).groupby(["group", "stage", "metric"], sort=False).agg(
        previous=("previous", "first"), n=("value", "count"), mean=("value", "mean"), std=("value", "std"),
        min=("value", "min"), max=("value", "max"), delta_mean=("delta", "mean"), delta_std=("delta", "std"),
        seeds=("seed", _seeds), variants=("variants", ",".join)).reset_index()
    out = out[out["n"] > 0]
    ranks = {
        "group": {g: i for i, g in enumerate(dict.fromkeys(summary["group"]))},
        "stage": {s: i for i, s in enumerate(pipeline_order(set(summary["stage"])))},
        "metric": {m: i for i, m in enumerate(metrics)},
    }
    out = out.sort_values(["group", "stage", "metric"], key=lambda column: column.map(ranks[column.name]))
    return out.reindex(columns=list(COLUMNS)).reset_index(drop=True)
