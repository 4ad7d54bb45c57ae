"""Training metrics: `metrics.jsonl` always, TensorBoard / W&B / MLflow when asked, a tqdm bar.

Only rank 0 logs. Records are one JSON object per line with a `step` field; a resumed run first
drops the records past its checkpoint (`truncate_after`) so the file reads as one clean run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from posttrain.stage_config import as_dict

LOGGERS = ("tensorboard", "wandb", "mlflow")
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class LoggerUnavailableError(RuntimeError):
    """A configured logger whose package is not installed."""


class LogDamagedError(ValueError):
    """A log line before the last that is not a record: damage, not a kill mid-write; the message names it."""


def read_log(path: Path) -> list[dict[str, Any]]:
    """The records of an append-only JSON-lines log a resume reads. A kill during an append leaves its last line
    cut short: that line is dropped, and said once. An earlier line that does not parse is damage: it raises,
    naming the file and line."""
    lines = [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").split("\n"), 1)
             if line.strip()]
    records = []
    for number, line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number != lines[-1][0]:
                raise LogDamagedError(f"{path}: line {number} is not a JSON record (damaged); delete {path.parent} "
                                      "to start over") from None
            print(f"{path}: dropped its last line, cut short by a kill during a write ({len(line)} bytes)", flush=True)
    return records


def truncate_after(path: Path, step: int) -> None:
    """Keep only the records of `path` with `step <= step` (the state a checkpoint saw), a torn last line dropped."""
    if not path.exists():
        return
    kept = [r for r in read_log(path) if r.get("step", 0) <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    tmp.replace(path)


def first_value(path: Path, key: str) -> float:
    """The first record's `key` in a metrics file (a resumed run's pre-training evaluation); NaN if absent."""
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if key in record:
            return float(record[key])
    return float("nan")


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory so far: allocated CUDA memory on GPU (reset each step), peak RSS on CPU (monotonic)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _require(name: str) -> None:
    if importlib.util.find_spec(_PACKAGES[name]) is None:
        raise LoggerUnavailableError(
            f"config key `loggers` asks for {name!r} but the package {_PACKAGES[name]!r} is not installed; "
            f"`pip install {_PACKAGES[name]}` (or `pip install posttrain[loggers]`) or remove it from `loggers`"
        )


class MetricsLogger:
    """Append-only metrics sink for rank 0; a no-op on other ranks.

    `log_dir` receives the optional loggers' local files (TensorBoard events, W&B offline runs,
    a file-based MLflow store unless MLFLOW_TRACKING_URI is set). W&B honours WANDB_MODE
    (`offline` needs no network).
    """

    def __init__(
        self,
        path: Path,
        *,
        enabled: bool = True,
        loggers: Sequence[str] = (),
        log_dir: Path | None = None,
        run_name: str = "posttrain",
        config: Mapping[str, Any] | None = None,
    ):
        self.path = Path(path)
        self.enabled = enabled
        unknown = sorted(set(loggers) - set(LOGGERS))
        if unknown:
            raise ValueError(f"config key `loggers`: unknown logger {unknown[0]!r}; choose from {', '.join(LOGGERS)}")
        for name in loggers:
            _require(name)
        self._loggers, self._log_dir, self._run_name, self._config = tuple(loggers), log_dir, run_name, config
        self._file: Any = None
        self._tb = self._wandb = self._mlflow = None

    def _open(self) -> None:
        """Open the sinks at the first record, so a run that fails before logging leaves no file behind."""
        loggers, run_name, config = self._loggers, self._run_name, self._config
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        log_dir = Path(self._log_dir or self.path.parent / "logs")
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(log_dir / "tensorboard"))
        if "wandb" in loggers:
            import wandb

            (log_dir / "wandb").mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "posttrain"),
                name=run_name,
                dir=str(log_dir / "wandb"),
                config=as_dict(config or {}),
                resume="allow",
                id=run_name.replace("/", "-"),
            )
        if "mlflow" in loggers:
            import mlflow

            if "MLFLOW_TRACKING_URI" not in os.environ:
                mlflow.set_tracking_uri((log_dir / "mlruns").resolve().as_uri())
            mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "posttrain"))
            self._mlflow = mlflow
            mlflow.start_run(run_name=run_name)

    def log(self, step: int, metrics: dict[str, float | int | str]) -> None:
        if not self.enabled:
            return
        if self._file is None:
            self._open()
        record = {"step": step, **metrics}
        self._file.write(json.dumps(record, sort_keys=False) + "\n")
        self._file.flush()
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._mlflow is not None:
            self._mlflow.log_metrics(numeric, step=step)

    def close(self) -> None:
        if not self.enabled or self._file is None:
            return
        self._file.close()
        self._file = None
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.end_run()


def progress_bar(total: int, initial: int, enabled: bool, desc: str) -> tqdm:
    """A step bar on rank 0 (tqdm's ETA from the step rate); callers set tokens/s as postfix."""
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit="step",
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=1.0,
    )
