"""The cross-variant summary table: one row per variant and evaluated stage.

Columns of `summary.tsv` (empty cell = not applicable or not measured):

    variant            ablation variant name
    stage              model-producing stage (sft, dpo, grpo, distill)
    key                the stage output's key (results/<stage>/<key>/)
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from posttrain.utils.io import PROVENANCE_FILE

HEAD_COLUMNS = ("variant", "stage", "key", "eval_key", "n_prompts", "accuracy")
TAIL_COLUMNS = ("reward", "response_len", "nll", "ppl", "pref_acc", "train_steps", "final_loss", "train_wall_time_s",
                "overrides")


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
    path = folder / "metrics.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing; run the evaluate stage for this model first") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None


def _last(records: Sequence[Mapping[str, Any]], field: str) -> Any:
    values = [r[field] for r in records if isinstance(r.get(field), (int, float))]
    return values[-1] if values else None


def _wall_time(folder: Path) -> float | None:
    path = folder / PROVENANCE_FILE
    return json.loads(path.read_text()).get("wall_time_s") if path.is_file() else None


def _overrides(overrides: Mapping[str, Any]) -> str:
    return ";".join(f"{k}={json.dumps(v)}" for k, v in overrides.items())


def summary_rows(variants: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows from the report config's `variants` (each a variant manifest: stages, eval, overrides)."""
    rows = []
    for name, manifest in variants.items():
        for stage, ref in manifest["eval"].items():
            metrics = _eval_metrics(Path(ref["path"]))
            model = manifest["stages"][stage]
            records = stage_records(model["path"])
            row = {"variant": name, "stage": stage, "key": model["key"], "eval_key": ref["key"]}
            row.update({k: v for k, v in metrics.items() if k in HEAD_COLUMNS[4:] + TAIL_COLUMNS or k.startswith("pass@")})
            row.update(train_steps=_last(records, "step"), final_loss=_last(records, "loss"),
                       train_wall_time_s=_wall_time(Path(model["path"])),
                       overrides=_overrides(manifest.get("overrides", {})))
            rows.append(row)
    return rows


def pass_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    return [f"pass@{k}" for k in sorted({int(c.split("@")[1]) for row in rows for c in row if c.startswith("pass@")})]


def summary_table(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The rows in the documented column order."""
    columns = [*HEAD_COLUMNS, *pass_columns(rows), *TAIL_COLUMNS]
    return pd.DataFrame(list(rows), columns=columns)
