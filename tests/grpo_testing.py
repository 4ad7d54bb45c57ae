"""Helpers for the GRPO stage tests: a partly-right starting policy, stage runs, per-step metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from sft_testing import ROOT, env_for, prepare_data, resolved_config, run_sft, write_config

GRPO_SCRIPT = ROOT / "stages" / "grpo.py"

# The default task family at a difficulty a quickly-trained tiny model gets partly right (see
# `starting_policy`): GRPO needs groups whose samples disagree.
TASK_DATA = {
    "tasks": [{"name": "sort", "length": 3, "max_value": 9}, {"name": "reverse", "length": 3, "max_value": 9}],
    "n_sft": 400, "n_preference": 8, "n_prompts": 256, "n_eval": 100, "max_seq_len": 64,
}
STARTING_SFT = {"steps": 60, "batch_size": 16, "lr": 3.0e-3, "warmup_steps": 5, "checkpoint_every": 1000, "log_every": 20}


def starting_policy(tmp: Path) -> tuple[Path, Path]:
    """(data folder, SFT model folder): the tiny preset briefly fine-tuned on the task data."""
    data = prepare_data(tmp, TASK_DATA)
    out = tmp / "sft"
    run_sft(resolved_config("sft", "grpo-start", data=TASK_DATA, sft=STARTING_SFT), data, out)
    return data, out


def grpo_config(key: str, data: dict[str, Any] | None = None, reward: dict[str, Any] | None = None,
                **grpo: Any) -> dict[str, Any]:
    """The default config's grpo section with overrides, on the task data's settings."""
    cfg = resolved_config("grpo", key, data={**TASK_DATA, **(data or {})}, grpo=grpo, reward=reward or {})
    cfg["upstream"] = {"prepare_data": "test-data", "dpo": "test-policy"}
    return cfg


def run_grpo(cfg: dict[str, Any], data: Path, model: Path, out: Path, check: bool = True, threads: int = 1,
             python: str = sys.executable, **env: str) -> subprocess.CompletedProcess:
    config = write_config(cfg, out.parent / f"{out.name}.json")
    command = [python, str(GRPO_SCRIPT), "--config", str(config), "--data", str(data), "--model", str(model),
               "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env_for(threads=threads, **env),
                          timeout=1800)
    if check and proc.returncode != 0:
        raise AssertionError(f"grpo exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def step_records(out: Path) -> list[dict[str, Any]]:
    """The per-step training records of a finished run's metrics.jsonl, in step order."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "samples" in r]


def summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "posttrain.json").read_text())["metrics"]


def length_reward(completion: str, example: dict[str, Any]) -> float:
    """A verifier any random policy earns varied rewards from: shorter completions score higher."""
    return 1.0 / (1.0 + len(completion))
