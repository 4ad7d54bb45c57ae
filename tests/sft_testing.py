"""Helpers shared by the SFT stage and resume tests: small resolved configs, data prep, stage runs."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from posttrain.model_files import read_safetensors, weight_files
from posttrain.workflow.schema import ConfigError, load_config, schema_problems

ROOT = Path(__file__).resolve().parent.parent
SFT_SCRIPT = ROOT / "stages" / "sft.py"
PREPARE_SCRIPT = ROOT / "stages" / "prepare_data.py"

# Small enough to prepare in seconds; the default tasks, a shorter sequence.
SMALL_DATA = {"n_sft": 600, "n_preference": 8, "n_prompts": 8, "n_eval": 60, "max_seq_len": 64}
SMALL_SFT = {"steps": 6, "batch_size": 8, "grad_accum": 1, "warmup_steps": 2, "checkpoint_every": 2, "log_every": 1}


def resolved_config(stage: str, key: str, data: dict[str, Any] | None = None, sft: dict[str, Any] | None = None,
                    **sections: dict[str, Any]) -> dict[str, Any]:
    """The default config with overrides per section, plus the stage/key/upstream a stage expects. Every key and
    value passes the schema snakemake validates with, so no test runs a setting a user could not write; the rules
    across keys and stages, and the files they read, are the dry run's (a stage test sets one stage's layout)."""
    cfg = load_config(ROOT / "config" / "config.yaml")
    cfg["data"].update(data or {})
    cfg["sft"].update(sft or {})
    for name, values in sections.items():
        cfg[name].update(values)
    problems = schema_problems(cfg)
    if problems:
        raise ConfigError(f"the test's {stage} config", problems)
    cfg.update(stage=stage, key=key, upstream={"prepare_data": "test-data"} if stage != "prepare_data" else {})
    return copy.deepcopy(cfg)


def write_config(cfg: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(cfg))
    return path


def env_for(threads: int = 1, **extra: str) -> dict[str, str]:
    """Environment of a stage process, one torch thread by default: test files run two at a time
    (conftest.py), and a fixed thread count keeps the stages' float reductions, so their results,
    the same whether the suite runs in parallel or not. The checkout comes first on `PYTHONPATH`
    (also when a test adds its own folder there), so a stage imports this checkout's `posttrain`,
    not whichever one is installed."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads), **extra}
    env.pop("POSTTRAIN_TEST_SIGKILL_AT_STEP", None)
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def prepare_data(tmp: Path, data: dict[str, Any] | None = None, seed: int | None = None,
                 model: dict[str, Any] | None = None, name: str = "data") -> Path:
    cfg = resolved_config("prepare_data", "test-data", data={**SMALL_DATA, **(data or {})}, model=model or {})
    if seed is not None:
        cfg["seed"] = seed
    out = tmp / name
    subprocess.run([sys.executable, str(PREPARE_SCRIPT), "--config", str(write_config(cfg, tmp / f"{name}.json")),
                    "--out", str(out)], check=True, capture_output=True, env=env_for(), cwd=ROOT)
    return out


def sft_command(config: Path, data: Path, out: Path, nproc: int = 1) -> list[str]:
    args = [str(SFT_SCRIPT), "--config", str(config), "--data", str(data), "--out", str(out)]
    if nproc == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone", *args]


def run_sft(cfg: dict[str, Any], data: Path, out: Path, nproc: int = 1, check: bool = True,
            **env: str) -> subprocess.CompletedProcess:
    config = write_config(cfg, out.parent / f"{out.name}.json")
    proc = subprocess.run(sft_command(config, data, out, nproc), capture_output=True, text=True, cwd=ROOT,
                          env=env_for(**env))
    if check and proc.returncode != 0:
        raise AssertionError(f"sft exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def run_stage_script(stage: str, cfg: dict[str, Any], data: Path, out: Path) -> Path:
    """`stages/<stage>.py` on the prepared data (its model from `cfg['model']`), in a subprocess; the output folder."""
    config = write_config(cfg, out.parent / f"{out.name}.json")
    proc = subprocess.run([sys.executable, str(ROOT / "stages" / f"{stage}.py"), "--config", str(config), "--data",
                           str(data), "--out", str(out)], capture_output=True, text=True, cwd=ROOT, env=env_for())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train_losses(records: list[dict[str, Any]]) -> list[float]:
    return [r["loss"] for r in records if "loss" in r]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return read_safetensors(weight_files(out))
