"""Report: summary.tsv has one row per variant and evaluated stage with the documented columns,
values taken from each eval and stage output; the figures are valid PNGs."""

import json

import matplotlib.image
import pandas as pd
import pytest
from eval_fixtures import load_stage, run_stage, write_config

from posttrain.evaluation.summary import HEAD_COLUMNS, TAIL_COLUMNS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EVAL_STAGES = ("sft", "dpo", "grpo", "distill")


def fake_results(root):
    """Two variants sharing data and SFT, differing from DPO on; evals of every model stage."""
    variants = {}
    for v, name in enumerate(("base", "beta0.2")):
        stages, evals = {"prepare_data": {"key": "d" * 12, "path": str(root / "data" / ("d" * 12))}}, {}
        for s, stage in enumerate(("sft", "dpo", "reward", "grpo", "distill")):
            key = f"{stage[:2]}{0 if stage == 'sft' else v}".ljust(12, "0")
            folder = root / stage / key
            folder.mkdir(parents=True, exist_ok=True)
            stages[stage] = {"key": key, "path": str(folder)}
            records = [{"step": step, "loss": (s + 1) / step + v, "lr": 1e-3} for step in range(1, 11)]
            (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            (folder / "posttrain.json").write_text(json.dumps({"stage": stage, "key": key, "wall_time_s": 10.0 * s}))
            if stage in EVAL_STAGES:
                eval_key = f"e{key}"[:12]
                evals[stage] = {"key": eval_key, "path": str(root / "eval" / eval_key)}
                (root / "eval" / eval_key).mkdir(parents=True, exist_ok=True)
                metrics = {"stage": stage, "model_key": key, "n_prompts": 50, "accuracy": 0.1 * s + 0.05 * v,
                           "pass@1": 0.2, "pass@4": 0.4 + v / 10, "reward": 0.3, "reward_by_verifier": {"task": 0.3},
                           "response_len": 7.5, "truncated": 0.0, "nll": 1.5 - 0.1 * s, "ppl": 4.0,
                           "pref_acc": 0.8 if stage == "dpo" else None, "per_task": {}, "lm_eval": {"skipped": "x"}}
                (root / "eval" / eval_key / "metrics.json").write_text(json.dumps(metrics))
        variants[name] = {"variant": name, "overrides": {} if v == 0 else {"dpo.beta": 0.2},
                          "stages": stages, "eval": evals, "export": {}}
    return write_config(root / "report.config.json",
                        {"stage": "report", "key": "r" * 12, "upstream": {}, "variants": variants})


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("results")
    run_stage(load_stage("report"), ["--config", fake_results(root), "--out", root / "report"], mp)
    mp.undo()
    return root / "report"


def test_summary_rows_columns_and_values(out):
    table = pd.read_csv(out / "summary.tsv", sep="\t")
    assert list(table.columns) == [*HEAD_COLUMNS, "pass@1", "pass@4", *TAIL_COLUMNS]
    assert len(table) == 2 * len(EVAL_STAGES)
    assert sorted(zip(table.variant, table.stage)) == sorted((v, s) for v in ("base", "beta0.2") for s in EVAL_STAGES)
    row = table[(table.variant == "beta0.2") & (table.stage == "dpo")].iloc[0]
    assert row.key == "dp1000000000" and row.eval_key == "edp100000000"
    assert row.accuracy == pytest.approx(0.15) and row["pass@4"] == pytest.approx(0.5) and row.pref_acc == 0.8
    assert row.train_steps == 10 and row.final_loss == pytest.approx(2 / 10 + 1) and row.train_wall_time_s == 10.0
    assert row.overrides == "dpo.beta=0.2"
    assert table[table.stage == "sft"].key.nunique() == 1  # shared SFT output
    assert table[table.stage != "dpo"].pref_acc.isna().all()


def test_figures_are_valid_pngs(out):
    for name in ("loss_curves.png", "eval_metrics.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
        assert image[..., :3].std() > 0.01  # not a blank canvas


def test_missing_eval_output_is_named(tmp_path, monkeypatch):
    config = fake_results(tmp_path)
    (tmp_path / "eval" / "edp100000000" / "metrics.json").unlink()
    with pytest.raises(FileNotFoundError, match="edp100000000/metrics.json"):
        run_stage(load_stage("report"), ["--config", config, "--out", tmp_path / "report"], monkeypatch)
    assert not (tmp_path / "report").exists()
