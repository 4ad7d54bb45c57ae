"""What confining a tool call costs: milliseconds per `run_python` call, against a bare interpreter and the sandbox
it replaced, measured in one run.

    python benchmarks/speed/sandbox.py [--calls 40] [--before d10ca52] [--update docs/benchmarks.md]

Each row runs the same small program (`print(sum(range(1000)))`) `--calls` times in turn with the others
(interleaved, so a busy moment weighs on every row alike) and reports the median and the 90th percentile:
- a bare interpreter: `python -S -c CODE` in a subprocess, no confinement (the floor of any per-call process);
- the same with site-packages (`python -c`), which the sandbox imports for the model's code;
- the sandbox before: `posttrain/envs/sandbox.py` at commit `--before` (an audit hook in the code's own interpreter,
  rlimits, a network namespace), read from git;
- the sandbox now: bubblewrap's namespaces, the seccomp filter, Landlock and the resource limits.
With `--update FILE` the table goes between FILE's `<!-- sandbox:begin -->` and `<!-- sandbox:end -->` markers,
with the machine, date, commit and this command beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
CODE = "print(sum(range(1000)))"


def before_sandbox(commit: str) -> Callable[[str], str]:
    """`run_python` of posttrain/envs/sandbox.py as it was at `commit`."""
    source = subprocess.run(["git", "show", f"{commit}:posttrain/envs/sandbox.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "sandbox_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sandbox_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.run_python


def bare(*flags: str) -> Callable[[str], str]:
    def run(code: str) -> str:
        return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, check=True).stdout
    return run


def measure(rows: dict[str, Callable[[str], str]], calls: int) -> dict[str, list[float]]:
    """Milliseconds per call of each row, the rows taking turns; every call's output checked."""
    times: dict[str, list[float]] = {name: [] for name in rows}
    for name, run in rows.items():  # warm-up: probes, caches, the filter's compilation
        assert run(CODE).strip() == "499500", name
    for _ in range(calls):
        for name, run in rows.items():
            start = time.perf_counter()
            out = run(CODE)
            times[name].append((time.perf_counter() - start) * 1000)
            assert out.strip() == "499500", (name, out)
    return times


def table(times: dict[str, list[float]]) -> str:
    floor = statistics.median(times["bare interpreter (python -S)"])
    lines = ["| per call | median ms | p90 ms | over a bare interpreter |", "|:--|--:|--:|--:|"]
    for name, values in times.items():
        median, p90 = statistics.median(values), statistics.quantiles(values, n=10)[-1]
        lines.append(f"| {name} | {median:.1f} | {p90:.1f} | {median / floor:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--before", default="d10ca52", help="the commit whose sandbox is the 'before' row")
    parser.add_argument("--update", type=Path, metavar="FILE", help="write the table between FILE's sandbox markers")
    args = parser.parse_args(argv)
    words = sys.argv[1:] if argv is None else list(argv)
    from _published import machine_line, publish
    from posttrain.envs.sandbox import run_python

    rows = {"bare interpreter (python -S)": bare("-S"), "bare interpreter with site-packages": bare(),
            f"sandbox before ({args.before}: audit hook, rlimits, network namespace)": before_sandbox(args.before),
            "sandbox now (namespaces, seccomp, Landlock, rlimits)": run_python}
    footer = machine_line("benchmarks/speed/sandbox.py", words, f"{args.calls} calls per row, interleaved, one at a "
                          f"time; Python {sys.version.split()[0]}")
    publish(table(measure(rows, args.calls)), footer, args.update, "sandbox")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
