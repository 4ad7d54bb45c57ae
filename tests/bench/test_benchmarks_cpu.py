"""benchmarks/speed/cpu_bf16.py runs on a model folder and reports both step times, their ratio and the CPU's bf16 flags;
benchmarks/memory/cp_memory.py measures context parallelism's activations per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from eval_fixtures import REPO, make_data, make_model
from posttrain.tokenizer import Tokenizer


def test_cpu_bf16_reports_both_step_times_and_the_flags(tmp_path, monkeypatch):
    data = make_data(tmp_path, monkeypatch)
    model = make_model(tmp_path, Tokenizer(data / "tokenizer"), "sft", "5f75f75f75f7", {}, seed=0)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "speed" / "cpu_bf16.py"), str(model), "--rows", "2",
                           "--seq", "8", "--steps", "1"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[0])
    assert result["float32_step_s"] > 0 and result["bf16_autocast_step_s"] > 0
    assert result["speedup"] == result["float32_step_s"] / result["bf16_autocast_step_s"]
    assert set(result["isa"]) >= {"avx512_bf16", "amx_bf16"} and "x on " in proc.stdout


def test_cp_memory_measures_both_layouts_on_the_same_loss():
    """benchmarks/memory/cp_memory.py: one process on the whole row and two on half each give the same loss; the
    activations each cp rank keeps are fewer (the ratio the docs quote is measured at a long sequence)."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory" / "cp_memory.py"), "--seq", "256", "--doc", "64",
                           "--layers", "1", "--hidden", "64"], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    one, two = result["cp1"], result["cp2"]
    assert abs(one["loss"] - two["loss"]) <= 1e-5 * abs(one["loss"])
    assert 0.4 < two["saved_mib"] / one["saved_mib"] < 0.8
    assert "ratio cp2/cp1 per rank" in proc.stdout
