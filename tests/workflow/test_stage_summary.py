"""The dry run's table of what each training stage will do: its steps, rows and tokens per step, the rows of its
split as data prep will count them (generated tasks, local sources' rows, the SFT rows held out), epochs."""

from __future__ import annotations

import json
import math
from pathlib import Path

from posttrain.workflow.plan import build_plan
from posttrain.workflow.schema import load_config, merge, validate_config
from posttrain.workflow.stage_summary import COLUMNS, summary_lines

BASE = load_config()


def _rows(cfg: dict) -> dict[str, dict[str, str]]:
    """The table's lines by stage (the first line of each), read back by column position."""
    lines = summary_lines(build_plan(cfg))
    header = lines[1]
    starts = [header.index(c) for c in COLUMNS] + [None]
    table = {}
    for line in lines[2:]:
        cells = {c: line[starts[i]:starts[i + 1]].strip() for i, c in enumerate(COLUMNS)}
        table.setdefault(cells["stage"], cells)
    return table


def test_default_config_steps_rows_and_epochs():
    cfg = validate_config(merge(BASE, {"ablations": None}))
    rows = _rows(cfg)
    assert list(rows) == ["sft", "dpo", "grpo", "distill"]
    data, dpo, grpo = cfg["data"], cfg["dpo"], cfg["grpo"]
    sft_docs = data["n_sft"] - min(data["n_eval"], data["n_sft"] // 10)
    assert rows["sft"]["trains on"] == f"{sft_docs} documents, packed" and rows["sft"]["epochs"] == "after data prep"
    assert rows["sft"]["tokens/step"] == f"<= {cfg['sft']['batch_size'] * data['max_seq_len']:,}"
    assert rows["dpo"]["steps"] == str(dpo["steps"]) and rows["dpo"]["trains on"] == f"{data['n_preference']} pairs"
    assert rows["dpo"]["epochs"] == f"{dpo['steps'] * dpo['batch_size'] / data['n_preference']:.2f}"
    prompts = min(data["n_prompts"], cfg["reward"]["n_prompts"])  # the reward stage samples at most its n_prompts
    assert rows["grpo"]["trains on"].startswith(f"{prompts} prompts (at most")
    assert rows["grpo"]["tokens/step"] == (
        f"<= {grpo['prompts_per_step'] * grpo['group_size'] * (data['max_seq_len'] + grpo['max_new_tokens']):,}")


def test_local_source_rows_epochs_and_prepared_data_count(tmp_path: Path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Q{i}", "chosen": "yes", "rejected": "no"}) + "\n" for i in range(7)))
    cfg = validate_config(merge(BASE, {
        "ablations": None, "results": str(tmp_path / "results"), "pipeline": ["sft", "dpo"],
        "data": {"sources": [{"kind": "preference", "path": str(pairs), "weight": 2}], "packing": False},
        "sft": {"epochs": 2}, "dpo": {"epochs": 0.5}}))
    rows = _rows(cfg)
    data = cfg["data"]
    pairs_total = data["n_preference"] + 14  # the file's 7 rows, twice by its weight
    assert rows["dpo"]["trains on"] == f"{pairs_total} pairs" and rows["dpo"]["epochs"] == "0.5"
    assert rows["dpo"]["steps"] == str(math.ceil(0.5 * pairs_total / cfg["dpo"]["batch_size"]))
    sft_docs = data["n_sft"] - min(data["n_eval"], data["n_sft"] // 10)
    assert rows["sft"]["steps"] == str(math.ceil(2 * sft_docs / cfg["sft"]["batch_size"]))  # unpacked: a row a document

    # once data prep has run, its stats.json counts
    data_job = next(iter(build_plan(cfg).variants.values())).stages["prepare_data"]
    Path(data_job.path).mkdir(parents=True)
    splits = {"sft": 100, "preference": 40, "prompts": 9, "eval": 5, "unpaired": 0, "sft_eval": 3}
    (Path(data_job.path) / "stats.json").write_text(json.dumps({"splits": {k: {"rows": v} for k, v in splits.items()}}))
    rows = _rows(cfg)
    assert rows["sft"]["trains on"] == "100 sft rows (as prepared)" and rows["sft"]["steps"] == str(math.ceil(2 * 100 / cfg["sft"]["batch_size"]))
    assert rows["dpo"]["trains on"] == "40 pairs"


def test_on_policy_pairs_and_band_prompts_count_once_reward_scoring_has_run(tmp_path: Path):
    cfg = validate_config(merge(BASE, {"ablations": None, "results": str(tmp_path / "results"),
                                       "dpo": {"pairs": "on_policy"}}))
    rows = _rows(cfg)
    assert rows["dpo"]["trains on"] == f"on-policy, <= {cfg['reward']['n_prompts']} from the reward stage"
    assert rows["dpo"]["epochs"] == "after reward scoring"
    variant = next(iter(build_plan(cfg).variants.values()))
    for job, counts in ((variant.stages["dpo"].inputs["pairs"], {"pairs": 24, "grpo_prompts": 30}),
                        (variant.stages["grpo"].inputs["reward"], {"pairs": 5, "grpo_prompts": 12})):
        Path(job.path).mkdir(parents=True)
        (Path(job.path) / "posttrain.json").write_text(json.dumps({"stage": "reward", "metrics": counts}))
    rows = _rows(cfg)
    dpo, grpo = cfg["dpo"], cfg["grpo"]
    assert rows["dpo"]["trains on"] == "24 pairs (on-policy, as scored)"  # the scoring of dpo's start, not grpo's
    assert rows["dpo"]["epochs"] == f"{dpo['steps'] * dpo['batch_size'] / 24:.2f}"
    assert rows["grpo"]["trains on"] == "12 prompts (the reward stage's band, as scored)"
    assert rows["grpo"]["epochs"] == f"{grpo['steps'] * grpo['prompts_per_step'] / 12:.2f}"


def test_the_readme_shows_the_default_configs_table(capsys):
    from posttrain.report.readme_table import markers
    from posttrain.workflow.stage_summary import main

    main([])
    begin, end = markers("dry-run")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    shown = readme[readme.index(begin) + len(begin):readme.index(end)].strip()
    assert shown.split("\n")[:-1] == capsys.readouterr().out.strip().split("\n")[:-1]  # all but the "made by" line
