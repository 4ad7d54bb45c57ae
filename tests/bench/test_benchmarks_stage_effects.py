"""benchmarks/quality/stage_effects.py on hand-written reports: the claims it checks and the bitwise comparison."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
sys.path[:0] = [str(BENCH), *(str(d) for d in sorted(BENCH.glob("[a-z]*/")))]  # benchmarks/ and its groups

import stage_effects  # noqa: E402

PREVIOUS = {"sft": "", "dpo": "sft", "grpo": "dpo", "distill": "grpo"}
GOOD = {"sft": (0.80, 0.70, None), "dpo": (0.79, 0.70, 0.95), "grpo": (0.80, 0.78, None), "distill": (0.75, 0.70, None)}


def write_report(results: Path, threads: int, metrics: dict, weight: float = 1.0) -> Path:
    """A finished sweep of one variant: summary.tsv, machine.json and each model's weights."""
    rows = []
    for stage, (accuracy, pass1, pref_acc) in metrics.items():
        key = stage.ljust(12, "0")
        (results / stage / key).mkdir(parents=True)
        save_file({"w": torch.full((2,), weight)}, str(results / stage / key / "model.safetensors"))
        rows.append({"variant": "seed1", "group": "default", "seed": 1, "stage": stage, "previous": PREVIOUS[stage],
                     "key": key, "eval_key": f"e{key[1:]}", "n_prompts": 180, "accuracy": accuracy, "pass@1": pass1,
                     "nll": 0.05, "pref_acc": pref_acc})
    report = results / "report"
    report.mkdir()
    pd.DataFrame(rows).to_csv(report / "summary.tsv", sep="\t", index=False)
    machine = {"cpu_model": "Test CPU", "arch": "x86_64", "isa": {"avx2": True}, "cpus_usable": 2,
               "report_torch_threads": 1, "date": "2026-12-01", "git_commit": "abc", "torch": "2.13.0",
               "stage_threads": {stage: {"k": threads} for stage in metrics}}
    (report / "machine.json").write_text(json.dumps(machine))
    return report


def test_every_claim_holds_and_identical_weights_are_reported(tmp_path, capsys):
    one = write_report(tmp_path / "t1", 1, GOOD)
    two = write_report(tmp_path / "t2", 2, GOOD)
    assert stage_effects.main([str(one), str(two)]) == 0
    out = capsys.readouterr().out
    assert out.count("| holds") == 8
    assert "distill: the student reaches >= 0.9x its teacher's greedy accuracy: holds in 2 of 2 runs" in out
    assert out.count("weights bitwise identical across thread counts in all 1 variants") == 4


def test_a_failing_claim_and_differing_weights_are_named(tmp_path, capsys):
    weak_student = {**GOOD, "distill": (0.70, 0.60, None)}  # 0.70 < 0.9 x 0.80
    no_grpo_gain = {**GOOD, "grpo": (0.80, 0.71, None)}  # pass@1 +0.01
    one = write_report(tmp_path / "t1", 1, weak_student)
    two = write_report(tmp_path / "t2", 2, no_grpo_gain, weight=1.25)
    assert stage_effects.main([str(one), str(two)]) == 1
    out = capsys.readouterr().out
    assert "holds in 1 of 2 runs" in out and out.count("FAILS") == 2
    assert out.count("weights differ across thread counts (largest elementwise difference 0.25)") == 4
