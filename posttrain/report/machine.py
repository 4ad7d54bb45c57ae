"""`machine.json`: the machine and threads behind a report's numbers.

The same seed gives different numbers on another CPU or thread count: the matmul kernels a CPU's
ISA selects (AVX2, AVX-512, AVX512-BF16, AMX) and the way threads split reductions change float
rounding, and over hundreds of steps that moves accuracies by points. So a table of results names
the CPU, its relevant flags and the threads every stage ran with (each stage's posttrain.json).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from posttrain.utils.provenance import git_commit, read_provenance

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
CPUINFO = Path("/proc/cpuinfo")


def cpu_model_and_flags(cpuinfo: Path = CPUINFO) -> tuple[str, set[str]]:
    """The first CPU's `model name` and `flags` from /proc/cpuinfo (platform's name, no flags, elsewhere)."""
    try:
        lines = cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return platform.processor() or platform.machine(), set()
    fields: dict[str, str] = {}
    for line in lines:
        if not line.strip():
            break  # the first processor's block ends here
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields.get("model name") or platform.processor() or platform.machine(), set(fields.get("flags", "").split())


def stage_threads(variants: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, int | None]]:
    """{stage: {output key: torch threads}} from every stage and eval output's posttrain.json
    (None where an output predates the `threads` record)."""
    out: dict[str, dict[str, int | None]] = {}
    for manifest in variants.values():
        refs = [*manifest["stages"].items(), *(("evaluate", ref) for ref in manifest["eval"].values())]
        for stage, ref in refs:
            out.setdefault(stage, {})[ref["key"]] = read_provenance(ref["path"]).get("threads")
    return out


def machine_info(variants: Mapping[str, Mapping[str, Any]], cpuinfo: Path = CPUINFO) -> dict[str, Any]:
    """What `machine.json` holds, for the report config's `variants` (each a variant manifest)."""
    model, flags = cpu_model_and_flags(cpuinfo)
    return {
        "cpu_model": model,
        "arch": platform.machine(),
        "isa": {flag: flag in flags for flag in ISA_FLAGS},
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "report_torch_threads": torch.get_num_threads(),
        "report_omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "stage_threads": stage_threads(variants),
        "git_commit": git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
