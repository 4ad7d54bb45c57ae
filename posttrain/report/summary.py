"""The cross-variant summary table: one row per variant and evaluated stage, in pipeline order.

Columns of `summary.tsv` (empty cell = not applicable or not measured):

    variant            ablation variant name
    group              the variant's overrides without `seed` (`default` when none): variants that
                       differ only in their seed form one group, aggregated by posttrain.report.effects
    seed               the stage's seed (its posttrain.json)
    stage              evaluated model: base (model.policy before training, with eval.base), sft, dpo, grpo, distill
    previous           the stage this one started from (sft: base, or empty without eval.base; distill: its teacher)
    key                the stage output's key (results/<stage>/<key>/; empty for base)
    eval_key           the evaluation's key (results/eval/<eval_key>/)
    n_prompts          eval prompts scored
    accuracy           greedy pass@1 on held-out problems
    pass@<k>           sampled pass@k, unbiased estimator, one column per k of eval.pass_k
    reward             mean verifier reward of the greedy completions
    response_len       mean generated tokens of the greedy completions
    nll, ppl           held-out NLL per token (sft_eval split) and perplexity
    pref_acc           implicit preference accuracy on held-out pairs (DPO models)
    train_steps        last step logged in the stage's metrics.jsonl
    final_loss         last `loss` logged in the stage's metrics.jsonl
    train_wall_time_s  the stage's wall time (posttrain.json)
    overrides          the variant's config overrides, `key=value` joined by `;`
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from posttrain.utils.io import read_json
from posttrain.utils.provenance import read_provenance
from posttrain.workflow.layout import pipeline_order

SEED_KEY = "seed"  # the override that makes replicates, not a different experiment
BASE_GROUP = "default"
HEAD_COLUMNS = ("variant", "group", "seed", "stage", "previous", "key", "eval_key", "n_prompts", "accuracy")
TAIL_COLUMNS = ("reward", "response_len", "nll", "ppl", "pref_acc", "train_steps", "final_loss", "train_wall_time_s",
                "overrides")
INTEGER_COLUMNS = ("seed", "n_prompts", "train_steps")
EVAL_COLUMNS = ("n_prompts", "accuracy", "reward", "response_len", "nll", "ppl", "pref_acc")  # and pass@k


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a `metrics.jsonl`; a bad line is an error naming the file and line."""
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: line {number}: not valid JSON ({err})") from None
    return records


def stage_records(folder: str | Path) -> list[dict[str, Any]]:
    """The training records of a stage output (`metrics.jsonl`), or none when it logged none."""
    path = Path(folder) / "metrics.jsonl"
    return read_jsonl(path) if path.is_file() else []


def _eval_metrics(folder: Path) -> dict[str, Any]:
    return read_json(folder / "metrics.json", "run the evaluate stage for this model first")


def _last(records: Sequence[Mapping[str, Any]], field: str) -> Any:
    values = [r[field] for r in records if isinstance(r.get(field), (int, float))]
    return values[-1] if values else None


def format_overrides(overrides: Mapping[str, Any]) -> str:
    return ";".join(f"{k}={json.dumps(v)}" for k, v in overrides.items())


def group_name(overrides: Mapping[str, Any]) -> str:
    """The variant's group: its overrides without the seed, so seed replicates share one name."""
    return format_overrides({k: v for k, v in overrides.items() if k != SEED_KEY}) or BASE_GROUP


def summary_rows(variants: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows from the report config's `variants` (each a variant manifest: stages, eval, previous, overrides)."""
    rows = []
    for name, manifest in variants.items():
        overrides = manifest.get("overrides", {})
        for stage in pipeline_order(manifest["eval"]):
            evaluation = manifest["eval"][stage]
            metrics = _eval_metrics(Path(evaluation["path"]))
            if stage in manifest["stages"]:
                model = manifest["stages"][stage]
                records, provenance, key = stage_records(model["path"]), read_provenance(model["path"]), model["key"]
                wall_time = provenance.get("wall_time_s")
            else:  # the base model: no stage output and no training; its eval has the seed
                records, provenance, key, wall_time = [], read_provenance(evaluation["path"]), None, None
            row = {"variant": name, "group": group_name(overrides), "seed": provenance.get("seed"), "stage": stage,
                   "previous": manifest["previous"][stage], "key": key, "eval_key": evaluation["key"]}
            row.update({k: v for k, v in metrics.items() if k in EVAL_COLUMNS or k.startswith("pass@")})
            row.update(train_steps=_last(records, "step"), final_loss=_last(records, "loss"),
                       train_wall_time_s=wall_time, overrides=format_overrides(overrides))
            rows.append(row)
    return rows


def pass_columns(names: Iterable[str]) -> list[str]:
    """The pass@k names among column names, by increasing k."""
    return [f"pass@{k}" for k in sorted({int(c.split("@")[1]) for c in names if c.startswith("pass@")})]


def summary_table(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The rows in the documented column order."""
    columns = [*HEAD_COLUMNS, *pass_columns(c for row in rows for c in row), *TAIL_COLUMNS]
    table = pd.DataFrame(list(rows), columns=columns)
    return table.astype({c: "Int64" for c in INTEGER_COLUMNS})  # no 1.23457e+07 seeds once a cell is empty


def read_summary(path: str | Path) -> pd.DataFrame:
    """`summary.tsv` read back (empty cells as NaN); a missing file or column is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; run the report stage first (snakemake <results>/report)")
    table = pd.read_csv(path, sep="\t", dtype={"variant": str, "group": str, "stage": str, "previous": str,
                                               "key": str, "eval_key": str, "overrides": str})
    missing = [c for c in HEAD_COLUMNS if c not in table.columns]
    if missing:
        raise ValueError(f"{path}: lacks column(s) {', '.join(missing)}; rerun the report stage")
    return table
