"""The default pipeline through Snakemake on models only the transformers backend runs (no native port).

prepare_data -> sft -> dpo -> reward -> grpo -> distill -> evaluate (every model stage) -> export, real
stage scripts with a few steps each, from a tiny random model folder of the family (its own BPE tokenizer
beside it) and a distillation student of the same family, on local chat data and the built-in tasks.
Every stage that runs a model says in its posttrain.json that transformers ran it (`model.backend: auto`
picks it), every model folder loads in `AutoModelForCausalLM` with the weights the stage wrote, and the
evaluations have their numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from hf_testing import save_family, transformers_weights
from sft_testing import env_for, weights
from snakemake_testing import copy_repo

transformers = pytest.importorskip("transformers")

WORKFLOW_FILES = ("Snakefile", "workflow", "config", "profiles", "stages", "posttrain", "envs")  # keys cover its code
MODEL_STAGES = ("sft", "dpo", "grpo", "distill")
TOKENIZER_VOCAB = 300
# The default pipeline, every stage a few steps (about 2 minutes on 2 cores).
OVERLAY = {
    "ablations": None,
    "data": {"n_sft": 48, "n_preference": 32, "n_prompts": 16, "n_eval": 16, "max_seq_len": 64},
    "sft": {"steps": 3, "batch_size": 8, "warmup_steps": 0, "checkpoint_every": 100, "log_every": 1},
    "dpo": {"steps": 2, "batch_size": 4, "warmup_steps": 0, "checkpoint_every": 100, "log_every": 1},
    "reward": {"n_prompts": 8, "samples_per_prompt": 2, "max_new_tokens": 8},
    "grpo": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8, "eval_prompts": 4,
             "warmup_steps": 0, "checkpoint_every": 100, "log_every": 1},
    "distill": {"steps": 2, "batch_size": 4, "warmup_steps": 0, "checkpoint_every": 100, "log_every": 1,
                "eval_prompts": 4, "max_new_tokens": 8},
    "eval": {"n_prompts": 4, "max_new_tokens": 8, "samples": 2, "pass_k": [1, 2]},
    "export": {"dtype": "float32"},
}


def chat_rows(n: int) -> list[dict]:
    """Local conversations in the `messages` shape (a `kind: sft` source)."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    return [{"messages": [{"role": "user", "content": f"Name word {i % 8} and then word {(i + 3) % 8}."},
                          {"role": "assistant", "content": f"{words[i % 8]} {words[(i + 3) % 8]}"}]} for i in range(n)]


def model_folders(root: Path, family: str, rows: list[dict]) -> tuple[Path, Path]:
    """(policy, student): random models of `family` (the student a layer smaller) sharing one BPE tokenizer."""
    from posttrain.tokenizer import train_bpe_tokenizer

    texts = [m["content"] for r in rows for m in r["messages"]] + [str(d) for d in range(100)]
    tok = train_bpe_tokenizer(texts, TOKENIZER_VOCAB, root / "tokenizer", model_max_length=128)
    ids = dict(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id)
    folders = root / "policy", root / "student"
    save_family(family, folders[0], **ids)
    save_family(family, folders[1], num_hidden_layers=1, **ids)
    for folder in folders:
        tok.save(folder)
    return folders


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["gpt_neox", "starcoder2", "granite"])
def test_every_stage_runs_a_model_only_transformers_runs(family, tmp_path):
    work = tmp_path / "repo"
    work.mkdir()
    copy_repo(work, WORKFLOW_FILES)
    rows = chat_rows(64)
    (work / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    policy, student = model_folders(tmp_path, family, rows)
    overlay = {**OVERLAY, "model": {"policy": str(policy), "student": str(student)},
               "data": {**OVERLAY["data"], "sources": [{"kind": "sft", "path": "chat.jsonl"}]}}
    (work / "overlay.yaml").write_text(yaml.safe_dump(overlay))

    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/local", "--cores", "2",
                           "--configfile", "overlay.yaml"], cwd=work, env=env_for(), capture_output=True, text=True,
                          timeout=540)
    print(f"{family}: the pipeline through Snakemake in {time.perf_counter() - start:.0f} s")
    logs = sorted((work / "results").rglob("logs/**/*.log"), key=lambda p: p.stat().st_mtime)[-2:]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:] + "".join(
        p.read_text(errors="replace")[-2000:] for p in logs)

    manifest = json.loads((work / "results" / "variants" / "default" / "manifest.json").read_text())
    outputs = {stage: work / ref["path"] for stage, ref in manifest["stages"].items()}
    outputs.update({f"eval-{stage}": work / ref["path"] for stage, ref in manifest["eval"].items()},
                   export=work / manifest["export"]["path"])
    assert set(outputs) == {"prepare_data", "reward", *MODEL_STAGES, *(f"eval-{s}" for s in MODEL_STAGES), "export"}
    records = {name: json.loads((folder / "posttrain.json").read_text()) for name, folder in outputs.items()}
    ran_by = {name: record["metrics"].get("model_backend") for name, record in records.items() if name != "prepare_data"}
    assert set(ran_by.values()) == {"transformers"}, ran_by

    architecture = json.loads((policy / "config.json").read_text())["architectures"]
    for name in (*MODEL_STAGES, "export"):
        folder = outputs[name]
        assert json.loads((folder / "config.json").read_text())["architectures"] == architecture, name
        written = weights(folder)
        loaded = transformers_weights(folder, tmp_path / f"resaved-{name}")
        assert set(written) == set(loaded) and all(torch.equal(loaded[k], v) for k, v in written.items()), name
    assert records["distill"]["metrics"]["student_params"] < records["distill"]["metrics"]["teacher_params"]
    exported, distilled = weights(outputs["export"]), weights(outputs["distill"])
    assert set(exported) == set(distilled) and all(torch.equal(exported[k], v) for k, v in distilled.items())

    for stage in MODEL_STAGES:
        metrics = json.loads((outputs[f"eval-{stage}"] / "metrics.json").read_text())
        assert metrics["stage"] == stage and 0.0 <= metrics["accuracy"] <= 1.0 and metrics["nll"] > 0, metrics
    assert json.loads((outputs["eval-dpo"] / "metrics.json").read_text())["pref_acc"] is not None
