"""Optional EleutherAI lm-evaluation-harness tasks on a model folder (the `lm-eval` extra).

The harness runs in its own process (`python -m lm_eval`, its Hugging Face backend) so its
dependencies and its hub downloads stay out of posttrain. Requested tasks that cannot run (not
installed: refused by the dry run already; task data unreachable, a crash) fail the stage with one
line (`LmEvalError`), unless `eval.lm_eval_optional` is true: then the result is
``{"skipped": reason}`` and the reason is printed. A requested benchmark is never silently missing.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posttrain.rules import lm_eval_problem

LOG_FILE = "lm_eval.log"


class LmEvalError(RuntimeError):
    """Requested lm-eval tasks that did not run, with `eval.lm_eval_optional` false."""


def _last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def run_lm_eval(model_dir: str | Path, tasks: Sequence[str], out_dir: str | Path, device: str,
                batch_size: int = 8, optional: bool = True) -> dict[str, Any]:
    """Run the harness on `tasks`; its output goes to `out_dir/lm_eval.log`.

    Returns ``{"tasks": [...], "results": {task: {metric: value}}}``, or ``{"skipped": reason}`` when it
    could not run and `optional`; raises `LmEvalError` when it could not and not `optional`.
    """
    if not tasks:
        return {"skipped": "eval.lm_eval_tasks is empty"}
    missing = lm_eval_problem(tasks, optional)
    if missing:
        raise LmEvalError(f"eval.lm_eval_tasks: {missing}")
    if importlib.util.find_spec("lm_eval") is None:
        return {"skipped": "lm-evaluation-harness is not installed (pip install 'posttrain[lm-eval]')"}
    log = Path(out_dir) / LOG_FILE
    with tempfile.TemporaryDirectory(prefix="lm_eval-") as tmp, log.open("w") as sink:
        cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={Path(model_dir).resolve()}",
               "--tasks", ",".join(tasks), "--device", device, "--batch_size", str(batch_size), "--output_path", tmp]
        sink.write("$ " + " ".join(cmd) + "\n")
        sink.flush()
        status = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT).returncode
        files = sorted(Path(tmp).rglob("results_*.json"))
        if status != 0 or not files:
            why = f"exited with status {status}" if status else "wrote no results file"
            reason = f"lm-eval {why} (task data unreachable?); last line of {LOG_FILE}: {_last_line(log)}"
            if not optional:
                raise LmEvalError(f"eval.lm_eval_tasks {list(tasks)}: {reason}; set eval.lm_eval_optional: true to "
                                  "go on without them")
            return {"skipped": reason}
        results = json.loads(files[-1].read_text())["results"]
    return {"tasks": list(tasks), "results": results}
