"""benchmarks/gpu/gpu_check.sh works end to end before it meets a GPU (--dry), and degrades where packages are missing."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
sys.path[:0] = [str(BENCH), *(str(d) for d in sorted(BENCH.glob("[a-z]*/")))]  # benchmarks/ and its groups

import gpu_check  # noqa: E402


@pytest.mark.slow
def test_dry_run_end_to_end(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "gpu_check.sh"), str(out), "--dry"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry"] and report["failed"] == []
    assert report["checks"]["all_reduce"]["ok"] and report["checks"]["bf16_matmul"]["relative_error"] < 2e-2
    assert [row["variant"] for row in report["sft"]] == list(gpu_check.VARIANTS)
    for row in report["sft"]:
        assert row["posttrain"]["ok"] and row["posttrain"]["useful_tokens_per_s"] > 0
        assert row["trl"]["ok"] and row["trl"]["useful_tokens_per_s"] > 0  # trl is installed here
    packing = report["sft"][2]["posttrain"]
    assert packing["useful_tokens_per_s"] / packing["tokens_per_s"] > 0.8  # packed rows are mostly real tokens
    assert "compile" in report["sft"][1]["posttrain"]["features"]
    assert "paper (1xH100)" in proc.stdout and "DRY RUN" in proc.stdout


def test_profile_dry_run_accounts_for_the_whole_step(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           str(ROOT / "benchmarks" / "speed" / "profile_step.py"), "--variant", "packing", "--dry",
                           "--json", str(out), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["dry"] and 0 < result["mfu"] < 1
    assert sum(result["seconds_per_step"].values()) == pytest.approx(result["step_s"], rel=0.05)  # host fills the rest
    assert result["seconds_per_step"]["matmul"] > 0 and result["seconds_per_step"]["attention"] > 0
    assert "MFU" in proc.stdout and "top ops" in proc.stdout


def test_profile_categories_follow_kernel_names():
    import profile_step

    assert profile_step.category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert profile_step.category("ncclDevKernel_AllGather_RING_LL") == "communication"
    assert profile_step.category("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert profile_step.category("NllLossBackward0") == "loss" and profile_step.category("aten::add_") == "other"
    assert profile_step.breakdown([("aten::mm", 2.0), ("aten::add_", 1.0)], wall_s=4.0)["host"] == 1.0


def test_gpu_all_parses_and_parts_selects_what_runs(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "gpu_all.sh"), str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "PARTS": "none"}, timeout=120)
    skipped = [line.split()[1].rstrip(":") for line in proc.stdout.splitlines() if line.endswith("not in PARTS, skipped")]
    assert skipped == ["pytest_gpu", "sft_memory", "dpo_memory", "dpo_memory_4bit", "profile_packing", "profile_eager",
                       "gpu_check"], proc.stdout + proc.stderr
    assert proc.returncode == 0  # nothing ran, nothing failed


def test_usage_errors():
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "gpu_check.sh")], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stderr
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "gpu_check.sh"), "/tmp/x", "--fast"],
                          capture_output=True, text=True)
    assert proc.returncode == 2


def test_trl_missing_is_reported_not_failed(tmp_path, monkeypatch, capsys):
    real = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None if name == "trl" else real(name))
    args = argparse.Namespace(out=tmp_path, work=tmp_path / "work", dry=True)
    gpu_check.run_trl(args)
    assert "trl not installed" in json.loads((tmp_path / "trl.json").read_text())["skipped"]
    (tmp_path / "ours.json").write_text(json.dumps({"all_reduce": {"ok": True}, "bf16_matmul": {"ok": True}, "sft": {
        name: {"ok": True, "useful_tokens_per_s": 10.0, "tokens_per_s": 20.0} for name in gpu_check.VARIANTS}}))
    assert gpu_check.report(args) == 0
    assert "TRL: not run: trl not installed" in capsys.readouterr().out
    (tmp_path / "ours.json").write_text(json.dumps({"all_reduce": {"ok": False, "error": "RuntimeError: x"}}))
    assert gpu_check.report(args) == 1
    assert "all_reduce" in json.loads((tmp_path / "gpu_check.json").read_text())["failed"]

