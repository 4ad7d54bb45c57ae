"""Builders shared by the evaluate / export tests: a tiny data folder, tiny model folders, stage runs."""

from __future__ import annotations

import json
import runpy
import sys
import time
from pathlib import Path

import torch

from posttrain.model_files import save_hf_model
from posttrain.models import Transformer, preset_config
from posttrain.tokenizer import Tokenizer
from posttrain.utils.provenance import write_provenance

REPO = Path(__file__).resolve().parents[1]
DATA_KEY = "d0d0d0d0d0d0"
DPO_CFG = {"loss": "sigmoid", "beta": 0.1, "label_smoothing": 0.0, "simpo_gamma": 0.5, "chosen_nll_weight": 0.0}


def run_stage(stage: str, argv: list, monkeypatch) -> None:
    """Run stages/<stage>.py in this process as its command line does (`python stages/<stage>.py ARGV`,
    through `run_main`: an expected failure is one line on stderr and SystemExit(1)).

    To replace a function the stage uses, monkeypatch it on its `posttrain` module first: the script's
    `from posttrain... import` runs here, so it picks up the replacement."""
    script = REPO / "stages" / f"{stage}.py"
    monkeypatch.setattr(sys, "argv", [str(script), *map(str, argv)])
    runpy.run_path(str(script), run_name="__main__")


def write_config(path: Path, cfg: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    return path


def make_data(results: Path, monkeypatch, n_eval: int = 12) -> Path:
    """results/data/<DATA_KEY>: two built-in tasks, a BPE tokenizer, every split small."""
    cfg = {
        "stage": "prepare_data", "key": DATA_KEY, "upstream": {}, "seed": 0,
        "model": {"policy": "tiny", "tokenizer": None, "chat_template": None},
        "data": {"tasks": [{"name": "arithmetic", "ops": ["add"], "digits": 2},
                           {"name": "sort", "length": 3, "max_value": 20}],
                 "n_sft": 60, "n_preference": 10, "n_prompts": 4, "n_eval": n_eval, "sources": [], "vocab_size": 300,
                 "max_seq_len": 64, "packing": True, "loss_mask": "assistant", "truncation": "right",
                 "on_bad_row": "error"},
    }
    out = results / "data" / DATA_KEY
    run_stage("prepare_data", ["--config", write_config(results / "data" / f"{DATA_KEY}.config.json", cfg),
                               "--out", out], monkeypatch)
    return out


def make_model(results: Path, tok: Tokenizer, stage: str, key: str, upstream: dict, seed: int,
               extra: dict | None = None) -> Path:
    """A random tiny Qwen3 model folder as a training stage writes it (weights, tokenizer, posttrain.json)."""
    torch.manual_seed(seed)
    hf = preset_config("tiny", tok.vocab_size, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    # head_dim 32: vLLM's CPU attention kernels do not take 16 (the export test loads this model in vLLM).
    hf.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32)
    model = Transformer(hf)
    out = results / stage / key
    save_hf_model(model.state_dict(), model.hf_config, out)
    tok.save(out)
    cfg = {"stage": stage, "key": key, "upstream": upstream, "seed": 0, "model": {"policy": "tiny"}, **(extra or {})}
    write_provenance(out, cfg, stage, time.time(), {"final_loss": 1.0})
    return out
