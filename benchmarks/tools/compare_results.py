"""Compare the weights of two finished results trees, stage by stage: byte-identical or not.

    python benchmarks/tools/compare_results.py BEFORE/results/smoke AFTER/results/smoke

A refactor that must not change what the pipeline computes is checked by running the same config
before and after it and comparing every safetensors file of every stage output. Stage keys may
differ between the two trees (they cover the code), so outputs are matched through the variant
views (`<results>/variants/<variant>/<stage>` links), not by key. Exits 1 when a file differs, or
is missing on one side, or when the trees share no variant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from posttrain.utils.io import file_sha256


def stage_outputs(results: Path) -> dict[tuple[str, str], Path]:
    """(variant, stage) -> the stage output folder its view links to."""
    views = results / "variants"
    if not views.is_dir():
        raise FileNotFoundError(f"{views}: no variant views; is {results} a finished results tree?")
    return {(variant.name, link.name): link.resolve()
            for variant in sorted(views.iterdir()) if variant.is_dir()
            for link in sorted(variant.iterdir()) if link.is_symlink()}


def weight_files(folder: Path) -> dict[str, Path]:
    return {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*.safetensors"))}


def compare(before: Path, after: Path) -> list[tuple[str, str, str, str]]:
    """One row per weight file: variant, stage, file, and `identical` / `DIFFERENT` / `missing in ...`."""
    a, b = stage_outputs(before), stage_outputs(after)
    rows = []
    for variant, stage in sorted(set(a) | set(b)):
        if (variant, stage) not in a or (variant, stage) not in b:
            side = "before" if (variant, stage) not in a else "after"
            rows.append((variant, stage, "*", f"missing in {side}"))
            continue
        files_a, files_b = weight_files(a[variant, stage]), weight_files(b[variant, stage])
        for name in sorted(set(files_a) | set(files_b)):
            if name not in files_a or name not in files_b:
                rows.append((variant, stage, name, f"missing in {'before' if name not in files_a else 'after'}"))
            else:
                same = file_sha256(files_a[name]) == file_sha256(files_b[name])
                rows.append((variant, stage, name, "identical" if same else "DIFFERENT"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", type=Path, help="results tree of the first run (e.g. results/smoke)")
    parser.add_argument("after", type=Path, help="results tree of the second run")
    args = parser.parse_args(argv)
    rows = compare(args.before, args.after)
    weights = [r for r in rows if r[2] != "*"]
    print(f"{'variant':<12} {'stage':<14} {'file':<34} result")
    for variant, stage, name, result in rows:
        if name != "*" or result.startswith("missing"):
            print(f"{variant:<12} {stage:<14} {name:<34} {result}")
    bad = [r for r in rows if r[3] != "identical"]
    print(f"{len(weights) - len([r for r in bad if r[2] != '*'])} of {len(weights)} weight files byte-identical")
    return 1 if bad or not weights else 0


if __name__ == "__main__":
    sys.exit(main())
