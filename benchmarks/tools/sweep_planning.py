"""Time `snakemake --dry-run` of a 20-variant sweep against a one-variant run of the same workflow.

    python benchmarks/tools/sweep_planning.py [--variants 20] [--repeats 3]

The requirement is a 20-variant plan in under 10 s on the 2-core machine. Planning validates the
config, resolves every variant's stage keys and writes each planned stage's resolved config, so
its cost grows with the variants; the ratio says how much of the sweep's time is per-variant work
and how much is Snakemake's start-up. Each run plans into a fresh temporary results folder (the
same grid as tests/workflow/test_workflow_snakemake.py); the best of `--repeats` wall times is reported,
with the CPU time the dry run used.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sweep_table(n: int) -> str:
    rows = [f"v{i:02d}\t{2 + i % 5}\t{1e-6 * (1 + i // 5):.1e}\t{i % 2}" for i in range(n)]
    return "variant\tgrpo.group_size\tgrpo.lr\tmemory.activation_checkpointing\n" + "\n".join(rows) + "\n"


def plan_seconds(variants: int) -> tuple[float, float]:
    """(wall, CPU) seconds of one dry run planning `variants` variants from scratch."""
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "ablations.tsv"
        table.write_text(sweep_table(variants))
        command = [sys.executable, "-m", "snakemake", "--dry-run", "--quiet", "--cores", "1",
                   "--config", f"ablations={table}", f"results={tmp}/results"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    one = min(plan_seconds(1) for _ in range(args.repeats))
    sweep = min(plan_seconds(args.variants) for _ in range(args.repeats))
    print(f"1 variant:  {one[0]:.2f} s wall, {one[1]:.2f} s CPU")
    print(f"{args.variants} variants: {sweep[0]:.2f} s wall, {sweep[1]:.2f} s CPU (target < 10 s)")
    print(f"ratio {args.variants} variants / 1 variant: {sweep[0] / one[0]:.2f}x wall")


if __name__ == "__main__":
    main()
