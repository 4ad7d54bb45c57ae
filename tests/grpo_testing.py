"""Helpers for the GRPO stage tests: a partly-right starting policy, stage runs, per-step metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from posttrain.model_files import save_hf_model
from posttrain.models import Transformer, preset_config
from posttrain.tokenizer import Tokenizer
from sft_testing import ROOT, SMALL_DATA, env_for, prepare_data, resolved_config, run_sft, write_config

GRPO_SCRIPT = ROOT / "stages" / "grpo.py"

# The default task family at a difficulty a quickly-trained tiny model gets partly right (see
# `starting_policy`): GRPO needs groups whose samples disagree.
TASK_DATA = {
    "tasks": [{"name": "sort", "length": 3, "max_value": 9}, {"name": "reverse", "length": 3, "max_value": 9}],
    "n_sft": 400, "n_preference": 8, "n_prompts": 256, "n_eval": 180, "max_seq_len": 64, "vocab_size": 300,
}
STARTING_SFT = {"steps": 300, "batch_size": 16, "lr": 3.0e-3, "warmup_steps": 5, "min_lr_ratio": 1.0,
                "checkpoint_every": 1000, "log_every": 20}


def starting_policy(tmp: Path, seed: int | None = None, threads: int = 1) -> tuple[Path, Path]:
    """(data folder, SFT model folder): the tiny preset briefly fine-tuned on the task data (the
    config's seed unless `seed` is given)."""
    data = prepare_data(tmp, TASK_DATA, seed=seed)
    out = tmp / "sft"
    cfg = resolved_config("sft", "grpo-start", data=TASK_DATA, sft=STARTING_SFT)
    if seed is not None:
        cfg["seed"] = seed
    # One torch thread by default: the same as the GRPO runs, and far faster than two on a loaded machine.
    run_sft(cfg, data, out, OMP_NUM_THREADS=str(threads))
    return data, out


RANDOM_DATA = {**SMALL_DATA, "n_prompts": 32}


def random_policy(tmp: Path, data_cfg: dict[str, Any] = RANDOM_DATA,
                  model_cfg: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """(data folder, model folder) of a small random model, for plumbing tests (pair with `length_reward`);
    `model_cfg`: the model section's overrides data prep reads (its chat template)."""
    data = prepare_data(tmp, data_cfg, model=model_cfg)
    tok = Tokenizer(data / "tokenizer")
    torch.manual_seed(0)
    hf = preset_config("tiny", tok.vocab_size, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    # head_dim 32: vLLM's CPU attention kernels do not take 16.
    hf.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              head_dim=32)
    model = tmp / "policy"
    save_hf_model(Transformer(hf).state_dict(), hf, model)
    tok.save(model)
    return data, model


def grpo_config(key: str, data: dict[str, Any] | None = None, reward: dict[str, Any] | None = None,
                environment: dict[str, Any] | None = None, **grpo: Any) -> dict[str, Any]:
    """The default config's grpo section with overrides, on the task data's settings (`environment`: the
    environment section's overrides, for multi-turn episodes)."""
    cfg = resolved_config("grpo", key, data={**TASK_DATA, **(data or {})}, grpo=grpo, reward=reward or {},
                          environment=environment or {})
    cfg["upstream"] = {"prepare_data": "test-data", "dpo": "test-policy"}
    return cfg


def run_grpo(cfg: dict[str, Any], data: Path, model: Path, out: Path, check: bool = True, threads: int = 1,
             nproc: int = 1, reward_model: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    config = write_config(cfg, out.parent / f"{out.name}.json")
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     "--nproc-per-node", str(nproc)]
    command = [*launcher, str(GRPO_SCRIPT), "--config", str(config), "--data", str(data), "--model", str(model),
               "--out", str(out), *(["--reward_model", str(reward_model)] if reward_model else [])]
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


def parity_reward(completion: str, example: dict[str, Any]) -> float:
    """A 0/1 verifier a random policy passes about half the time, so some groups of its samples are flat."""
    return float(len(completion) % 2 == 0)


def length_reward(completion: str, example: dict[str, Any]) -> float:
    """A verifier any random policy earns varied rewards from: shorter completions score higher."""
    return 1.0 / (1.0 + len(completion))


def digit_reward(completion: str, example: dict[str, Any]) -> float:
    """The share of digits in a completion: a random model's samples vary in it, and GRPO raises it in a few steps."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


# Two-digit sums: short answers a briefly trained model gives as a number and then ends its turn.
GAME_DATA = {"tasks": [{"name": "arithmetic", "ops": ["add"], "digits": 2}], "n_sft": 200, "n_preference": 4,
             "n_prompts": 32, "n_eval": 8, "max_seq_len": 48, "vocab_size": 300}
GUESS_NUMBER = {"fn": "guess_number", "max_turns": 3, "max_tokens": 80, "args": {"high": 4}}


def turn_ending_policy(tmp: Path) -> tuple[Path, Path]:
    """(data folder, model folder): `random_policy`'s shape (vLLM takes it) fine-tuned for 60 steps on GAME_DATA,
    so it answers with a number and ends its turn: guess-the-number episodes (GUESS_NUMBER) run several turns,
    where a random model's first turn is cut by the token cap."""
    data, start = random_policy(tmp, GAME_DATA)
    cfg = resolved_config("sft", "turn-ending", data=GAME_DATA, model={"policy": str(start)},
                          sft={"steps": 60, "batch_size": 16, "lr": 3e-3, "warmup_steps": 5, "checkpoint_every": 1000})
    run_sft(cfg, data, tmp / "turn-ending")
    return data, tmp / "turn-ending"
