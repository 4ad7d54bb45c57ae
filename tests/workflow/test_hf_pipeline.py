"""The default pipeline through Snakemake on the families beyond Llama and Qwen: each native port, and models
only the transformers backend runs.

prepare_data -> sft -> dpo -> reward -> grpo -> distill -> evaluate (every model stage) -> export, real
stage scripts with a few steps each, from a tiny random model folder of the family (its own BPE tokenizer
beside it) and a distillation student of the same family, on local chat data and the built-in tasks.
Every stage that runs a model says in its posttrain.json which backend ran it (`model.backend: auto`
picks it), every model folder loads in `AutoModelForCausalLM` with the weights the stage wrote and keeps
the family's switches (windows, layer types), and the evaluations have their numbers. The native ports run
as one ablation table, a variant per family, as a researcher comparing families would.
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

from hf_testing import NATIVE_FAMILIES, save_family, transformers_weights
from sft_testing import env_for, weights
from snakemake_testing import copy_repo

transformers = pytest.importorskip("transformers")

WORKFLOW_FILES = ("Snakefile", "workflow", "config", "profiles", "stages", "posttrain", "envs")  # keys cover its code
MODEL_STAGES = ("sft", "dpo", "grpo", "distill")
TOKENIZER_VOCAB = 300
NATIVE = ("mistral", "gemma3_text", "phi3", "olmo2", "smollm3")
# What makes each native family itself in config.json: a stage must write them back as it read them.
SWITCHES = ("sliding_window", "layer_types", "no_rope_layers", "partial_rotary_factor", "query_pre_attn_scalar",
            "num_hidden_layers", "tie_word_embeddings")
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


def shared_tokenizer(root: Path, rows: list[dict]):
    """A BPE tokenizer trained on the chat data and the digits, in `root/tokenizer`."""
    from posttrain.tokenizer import train_bpe_tokenizer

    texts = [m["content"] for r in rows for m in r["messages"]] + [str(d) for d in range(100)]
    return train_bpe_tokenizer(texts, TOKENIZER_VOCAB, root / "tokenizer", model_max_length=128)


def model_folders(root: Path, family: str, tok) -> tuple[Path, Path]:
    """(policy, student): a random model of `family` with the tokenizer `tok` and a student of the family: a native
    port's pruned from the policy to two layers (as users make one), a transformers-only family's built with one."""
    from posttrain.model_files.prune import prune

    ids = dict(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id)
    policy, student = root / family / "policy", root / family / "student"
    save_family(family, policy, **ids)
    tok.save(policy)
    if family in NATIVE_FAMILIES:
        return policy, prune(policy, student, keep=2)
    save_family(family, student, num_hidden_layers=1, **ids)
    tok.save(student)
    return policy, student


def write_workflow(work: Path, rows: list[dict], overlay: dict) -> None:
    """The repository, the chat data and `overlay.yaml` (OVERLAY with `overlay` on top) in `work`."""
    work.mkdir()
    copy_repo(work, WORKFLOW_FILES)
    (work / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    merged = {**OVERLAY, **overlay, "data": {**OVERLAY["data"], "sources": [{"kind": "sft", "path": "chat.jsonl"}]}}
    (work / "overlay.yaml").write_text(yaml.safe_dump(merged))


def run_snakemake(work: Path, label: str, timeout: int) -> None:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/local", "--cores", "2",
                           "--configfile", "overlay.yaml"], cwd=work, env=env_for(), capture_output=True, text=True,
                          timeout=timeout)
    print(f"{label}: the pipeline through Snakemake in {time.perf_counter() - start:.0f} s")
    logs = sorted((work / "results").rglob("logs/**/*.log"), key=lambda p: p.stat().st_mtime)[-2:]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:] + "".join(
        p.read_text(errors="replace")[-2000:] for p in logs)


def check_variant(work: Path, variant: str, policy: Path, backend: str, scratch: Path) -> None:
    """Every stage of `variant` ran on `backend`; every model folder is the family's, loads in transformers with the
    stage's weights and keeps the policy's config switches; the evaluations have numbers."""
    manifest = json.loads((work / "results" / "variants" / variant / "manifest.json").read_text())
    outputs = {stage: work / ref["path"] for stage, ref in manifest["stages"].items()}
    outputs.update({f"eval-{stage}": work / ref["path"] for stage, ref in manifest["eval"].items()},
                   export=work / manifest["export"]["path"])
    assert set(outputs) == {"prepare_data", "reward", *MODEL_STAGES, *(f"eval-{s}" for s in MODEL_STAGES), "export"}
    records = {name: json.loads((folder / "posttrain.json").read_text()) for name, folder in outputs.items()}
    ran_by = {name: record["metrics"].get("model_backend") for name, record in records.items() if name != "prepare_data"}
    assert set(ran_by.values()) == {backend}, (variant, ran_by)

    config = json.loads((policy / "config.json").read_text())
    switches = {k: config[k] for k in SWITCHES if k in config}
    for name in (*MODEL_STAGES, "export"):
        folder = outputs[name]
        written_config = json.loads((folder / "config.json").read_text())
        assert written_config["architectures"] == config["architectures"], (variant, name)
        if name in ("sft", "dpo", "grpo"):  # the policy's own shape (distill and export hold the pruned student)
            assert {k: written_config.get(k) for k in switches} == switches, (variant, name)
        written = weights(folder)
        loaded = transformers_weights(folder, scratch / f"resaved-{variant}-{name}")
        assert set(written) == set(loaded) and all(torch.equal(loaded[k], v) for k, v in written.items()), (variant, name)
    assert records["distill"]["metrics"]["student_params"] < records["distill"]["metrics"]["teacher_params"]
    exported, distilled = weights(outputs["export"]), weights(outputs["distill"])
    assert set(exported) == set(distilled) and all(torch.equal(exported[k], v) for k, v in distilled.items())

    for stage in MODEL_STAGES:
        metrics = json.loads((outputs[f"eval-{stage}"] / "metrics.json").read_text())
        assert metrics["stage"] == stage and 0.0 <= metrics["accuracy"] <= 1.0 and metrics["nll"] > 0, metrics
    assert json.loads((outputs["eval-dpo"] / "metrics.json").read_text())["pref_acc"] is not None


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["gpt_neox", "starcoder2", "granite"])
def test_every_stage_runs_a_model_only_transformers_runs(family, tmp_path):
    rows = chat_rows(64)
    policy, student = model_folders(tmp_path, family, shared_tokenizer(tmp_path, rows))
    work = tmp_path / "repo"
    write_workflow(work, rows, {"model": {"policy": str(policy), "student": str(student)}})
    run_snakemake(work, family, timeout=540)
    check_variant(work, "default", policy, "transformers", tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_stage_runs_each_native_family_in_one_ablation_table(tmp_path):
    """A variant per family (`model.policy`, `model.student` columns): windows shorter than the rows in Mistral,
    Gemma 3 and Phi-3, Gemma 3's local/global layers, Phi-3's fused projections, OLMo 2's norms, SmolLM3's layers
    without rope, each through every stage on the native code."""
    rows = chat_rows(64)
    tok = shared_tokenizer(tmp_path, rows)
    folders = {family: model_folders(tmp_path, family, tok) for family in NATIVE}
    work = tmp_path / "repo"
    table = "variant\tmodel.policy\tmodel.student\n" + "".join(
        f"{family}\t{policy}\t{student}\n" for family, (policy, student) in folders.items())
    write_workflow(work, rows, {"ablations": "families.tsv", "model": {"tokenizer": str(tmp_path / "tokenizer")}})
    (work / "families.tsv").write_text(table)
    run_snakemake(work, "native families", timeout=1100)
    data_preps = {json.loads((work / "results" / "variants" / f / "manifest.json").read_text())["stages"]["prepare_data"]["path"]
                  for f in NATIVE}
    assert len(data_preps) == 1, data_preps  # `model.tokenizer`: one data preparation for every variant
    for family, (policy, _) in folders.items():
        check_variant(work, family, policy, "native", tmp_path)
