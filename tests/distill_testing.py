"""Helpers of the distillation tests: resolved configs, random teacher folders, stage runs."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from posttrain.model_files import save_hf_model
from posttrain.models import Transformer, preset_config
from posttrain.tokenizer import Tokenizer
from posttrain.utils.provenance import write_provenance
from sft_testing import ROOT, SMALL_DATA, env_for, resolved_config, write_config

DISTILL_SCRIPT = ROOT / "stages" / "distill.py"
SMALL_DISTILL = {"steps": 6, "batch_size": 8, "warmup_steps": 2, "checkpoint_every": 2, "log_every": 1,
                 "eval_prompts": 8, "max_new_tokens": 12}


def distill_config(key: str, distill: dict[str, Any] | None = None, data: dict[str, Any] | None = None,
                   **sections: dict[str, Any]) -> dict[str, Any]:
    cfg = resolved_config("distill", key, data={**SMALL_DATA, **(data or {})}, **sections)
    cfg["distill"].update({**SMALL_DISTILL, **(distill or {})})
    cfg["upstream"] = {"prepare_data": "test-data", "grpo": "test-teacher"}
    return cfg


def random_model_folder(out: Path, tokenizer: Tokenizer, preset: str = "tiny", seed: int = 0,
                        vocab_size: int | None = None) -> Path:
    """A randomly initialized model folder with the tokenizer, as a training stage writes it."""
    torch.manual_seed(seed)
    hf = preset_config(preset, vocab_size or tokenizer.vocab_size, eos_token_id=tokenizer.eos_id,
                       pad_token_id=tokenizer.pad_id)
    save_hf_model(Transformer(hf).state_dict(), hf, out)
    tokenizer.save(out)
    write_provenance(out, {"key": "test-teacher", "seed": seed}, "grpo", time.time(), {})
    return out


def distill_command(config: Path, data: Path, teacher: Path, out: Path, nproc: int = 1) -> list[str]:
    args = [str(DISTILL_SCRIPT), "--config", str(config), "--data", str(data), "--teacher", str(teacher),
            "--out", str(out)]
    if nproc == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone", *args]


def run_distill(cfg: dict[str, Any], data: Path, teacher: Path, out: Path, nproc: int = 1, check: bool = True,
                **env: str) -> subprocess.CompletedProcess:
    config = write_config(cfg, out.parent / f"{out.name}.json")
    proc = subprocess.run(distill_command(config, data, teacher, out, nproc), capture_output=True, text=True,
                          cwd=ROOT, env=env_for(threads=1, **env), timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"distill exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc
