"""LoRA in GRPO, distillation and the reward model, and adapter-only outputs (`<stage>.save: adapter`).

Each stage runs on a tiny random model: the adapters train (the reward rises, the loss falls) while every base
weight stays bitwise what it was; a killed LoRA GRPO run resumes to the uninterrupted run's weights; an
adapter-only output loads with PEFT like the merged output and, through `model_files.model_tensors`, as a
later stage's input (distillation's teacher here); the dry run refuses what the stages would.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_testing import grpo_config, run_grpo, step_records
from lora_testing import assert_only_adapters_trained
from distill_testing import distill_config, random_model_folder, run_distill
from sft_testing import (ROOT, SMALL_DATA, env_for, metrics, prepare_data, resolved_config, run_stage_script, train_losses,
                         weights, write_config)
from posttrain.model_files import model_tensors, read_safetensors, save_hf_model
from posttrain.models import Transformer, preset_config
from posttrain.rewards import load_reward_model
from posttrain.tokenizer import Tokenizer
from posttrain.training.checkpointer import resume_dir
from posttrain.workflow.schema import ConfigError, load_config, validate_config

ENV = {"PYTHONPATH": str(ROOT / "tests")}  # the stages import grpo_testing's `digit_reward`
DATA = {**SMALL_DATA, "n_prompts": 32, "n_preference": 20}
# lm_head (untied) takes an adapter too, so a few steps move a random model's output distribution.
LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": ["q_proj", "v_proj", "lm_head"]}
GRPO = dict(steps=6, checkpoint_every=2, prompts_per_step=4, group_size=4, max_new_tokens=8, eval_prompts=4, lr=0.2,
            warmup_steps=0, kl_coef=0.01, method="lora", lora=LORA)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    """The data and a small random policy with untied output embeddings."""
    tmp = tmp_path_factory.mktemp("lora-stages")
    data = prepare_data(tmp, DATA)
    tok = Tokenizer(data / "tokenizer")
    torch.manual_seed(0)
    hf = preset_config("tiny", tok.vocab_size, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    hf.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              head_dim=32, tie_word_embeddings=False)
    policy = tmp / "policy"
    save_hf_model(Transformer(hf).state_dict(), hf, policy)
    tok.save(policy)
    return {"tmp": tmp, "data": data, "policy": policy}


def lora_grpo(save: str = "both") -> dict[str, Any]:
    return grpo_config(f"lora-{save}", data=DATA, reward={"verifiers": ["grpo_testing:digit_reward"]}, save=save, **GRPO)


@pytest.fixture(scope="module")
def grpo_whole(setup) -> Path:
    out = setup["tmp"] / "grpo-whole"
    run_grpo(lora_grpo(), setup["data"], setup["policy"], out, **ENV)
    return out


def test_lora_grpo_raises_the_reward_training_only_the_adapters(setup, grpo_whole):
    """The reward rises; the KL to the reference is 0 at the first step and grows after it, so the reference is the
    starting policy (the adapters disabled), not the policy itself; the base weights are the start's, bitwise."""
    records = step_records(grpo_whole)
    rewards = [r["reward_mean"] for r in records]
    assert rewards[-1] > rewards[0] + 0.3, rewards
    assert records[0]["kl"] == 0 and all(r["kl"] > 0 for r in records[1:]), [r["kl"] for r in records]
    start = model_tensors(setup["policy"])
    adapted = assert_only_adapters_trained(start, grpo_whole, grpo_whole / "adapter", LORA["alpha"] / LORA["rank"])
    assert adapted == 2 * 2 + 1  # q_proj and v_proj of two layers, lm_head


def test_killed_lora_grpo_run_resumes_bitwise(setup, grpo_whole):
    killed = setup["tmp"] / "grpo-killed"
    proc = run_grpo(lora_grpo(), setup["data"], setup["policy"], killed, check=False,
                    POSTTRAIN_TEST_SIGKILL_AT_STEP="3", **ENV)
    assert proc.returncode != 0 and not killed.exists() and resume_dir(killed).exists()
    proc = run_grpo(lora_grpo(), setup["data"], setup["policy"], killed, **ENV)
    assert "resuming from" in proc.stdout
    for read in (weights, lambda out: read_safetensors([out / "adapter" / "adapter_model.safetensors"])):
        a, b = read(grpo_whole), read(killed)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    start = model_tensors(setup["policy"])
    assert not torch.equal(weights(killed)["lm_head.weight"], start["lm_head.weight"])
    assert [r["reward_mean"] for r in step_records(killed)] == [r["reward_mean"] for r in step_records(grpo_whole)]


@pytest.fixture(scope="module")
def grpo_adapter(setup) -> Path:
    out = setup["tmp"] / "grpo-adapter"
    run_grpo(lora_grpo("adapter"), setup["data"], setup["policy"], out, **ENV)
    return out


def test_adapter_only_output_loads_with_peft_like_the_merged_output(setup, grpo_whole, grpo_adapter):
    """`save: adapter` writes the PEFT adapter and no weights; PEFT on the base gives the merged output's logits, and
    the one reader of model folders gives the merged output's weights bitwise."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    files = sorted(p.name for p in grpo_adapter.iterdir())
    assert "model.safetensors" not in files and "adapter" not in files
    assert {"adapter_config.json", "adapter_model.safetensors", "config.json", "metrics.jsonl", "posttrain.json",
            "tokenizer.json"} <= set(files)
    assert json.loads((grpo_adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(setup["policy"])
    merged = weights(grpo_whole)
    ours = model_tensors(grpo_adapter)
    assert ours.keys() == merged.keys() and all(torch.equal(ours[k], merged[k]) for k in merged)

    base = transformers.AutoModelForCausalLM.from_pretrained(setup["policy"], torch_dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, grpo_adapter).eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(grpo_whole, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, reference.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = with_adapter(input_ids=ids).logits, reference(input_ids=ids).logits
        with with_adapter.disable_adapter():
            untrained = with_adapter(input_ids=ids).logits
    # float32, the adapter applied unmerged vs merged: equal to rounding, 1e-5 of the logits' size (~50 here)
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert (b - untrained).abs().max() > 1.0


def test_lora_distillation_from_an_adapter_only_teacher(setup, grpo_adapter):
    """The teacher is GRPO's adapter-only output (loaded as base + adapter); the LoRA student's loss falls and only its
    adapters change."""
    tok = Tokenizer(setup["data"] / "tokenizer")
    student = random_model_folder(setup["tmp"] / "student", tok, preset="tiny-student", seed=1)
    cfg = distill_config("lora", {"steps": 8, "lr": 3e-2, "method": "lora", "checkpoint_every": 1000,
                                  "lora": {**LORA, "targets": ["q_proj", "v_proj", "down_proj"]}}, data=DATA)
    cfg["model"]["student"] = str(student)
    out = setup["tmp"] / "distill"
    run_distill(cfg, setup["data"], grpo_adapter, out)
    losses = train_losses(metrics(out))
    assert len(losses) == 8 and sum(losses[-2:]) < sum(losses[:2]), losses
    assert assert_only_adapters_trained(model_tensors(student), out, out / "adapter", LORA["alpha"] / LORA["rank"]) > 0


def test_lora_reward_model_trains_its_adapters_and_its_score_head(setup):
    """Every step takes the same 16 pairs, so the Bradley-Terry loss falls; the decoder's base weights stay the policy's
    and the new score head trains in full, saved with the adapter (PEFT's modules_to_save)."""
    cfg = resolved_config("reward_model", "lora-rm", data=DATA, reward_model={
        "source": "train", "method": "lora", "lora": {**LORA, "targets": ["q_proj", "v_proj", "down_proj"]}, "steps": 8,
        "batch_size": 16, "held_out": 0.2, "lr": 1e-2, "warmup_steps": 0, "eval_every": 8, "checkpoint_every": 1000})
    out = setup["tmp"] / "rm"
    config = write_config(cfg, setup["tmp"] / "rm.json")
    proc = subprocess.run([sys.executable, str(ROOT / "stages" / "reward_model.py"), "--config", str(config), "--data",
                           str(setup["data"]), "--model", str(setup["policy"]), "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, env=env_for(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = train_losses(metrics(out))
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    adapter_cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["task_type"] == "SEQ_CLS" and adapter_cfg["modules_to_save"] == ["score"]
    torch.manual_seed(cfg["seed"])  # the stage's seed draws the new head (load_reward_model from a causal LM)
    start = load_reward_model(setup["policy"]).state_dict()
    assert assert_only_adapters_trained(start, out, out / "adapter", LORA["alpha"] / LORA["rank"], head="score") == 6
    assert load_reward_model(out).score.weight.equal(weights(out)["score.weight"])


def _problems(cfg: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, where="test.yaml")
    return str(err.value)


def test_the_dry_run_refuses_adapter_saves_without_adapters_and_lora_under_tensor_parallelism():
    base = load_config(ROOT / "config" / "config.yaml")
    cfg = copy.deepcopy(base)
    cfg["reward_model"]["source"] = "train"
    for stage in ("sft", "dpo", "grpo", "distill", "reward_model"):
        cfg[stage]["save"] = "adapter"
    text = _problems(cfg)
    for stage in ("sft", "dpo", "grpo", "distill", "reward_model"):
        assert f"{stage}.save: adapter: {stage}.method is full, which trains every weight" in text, text
    cfg = copy.deepcopy(base)
    cfg["parallel"]["tp"] = 2
    cfg["grpo"]["method"], cfg["distill"]["method"] = "lora", "qlora"
    text = _problems(cfg)
    assert "grpo.method: lora: tensor parallelism does not support LoRA/QLoRA adapters" in text
    assert "distill.method: qlora: tensor parallelism does not support LoRA/QLoRA adapters" in text
    # the preset start (sft first from model.policy tiny; distillation's tiny-student) holds no base weights
    cfg = copy.deepcopy(base)
    for stage in ("sft", "dpo", "distill"):
        cfg[stage].update(method="lora", save="adapter")
    text = _problems(cfg)
    assert "sft.save: adapter: the stage starts from a preset's random weights" in text
    assert "distill.save: adapter: the stage starts from a preset's random weights" in text
    assert "dpo.save" not in text  # dpo starts from sft's output folder
    cfg["sft"]["save"] = cfg["distill"]["save"] = "both"
    assert validate_config(cfg)["dpo"]["save"] == "adapter"


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_lora_sft_and_dpo_train_and_their_adapter_only_outputs_load_with_peft(stage, setup):
    """The first stages too: the loss falls, the adapter alone (`save: adapter`) loads with PEFT on the start
    model and gives the merged output's logits."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    section = {"steps": 8, "batch_size": 8, "lr": 2e-2, "warmup_steps": 0, "checkpoint_every": 1000, "log_every": 100,
               "method": "lora", "lora": LORA}
    outs = {}
    for save in ("both", "adapter"):
        cfg = resolved_config(stage, f"lora-{stage}-{save}", data=DATA, model={"policy": str(setup["policy"])},
                              **{stage: {**section, "save": save}})
        outs[save] = run_stage_script(stage, cfg, setup["data"], setup["tmp"] / f"{stage}-{save}")
    losses = train_losses(metrics(outs["both"]))
    assert len(losses) == 8 and sum(losses[-2:]) / 2 < losses[0] - 0.05, losses
    assert train_losses(metrics(outs["adapter"])) == losses  # the save changes what is written, not the run
    assert "model.safetensors" not in {p.name for p in outs["adapter"].iterdir()}
    adapted = assert_only_adapters_trained(model_tensors(setup["policy"]), outs["both"], outs["both"] / "adapter",
                                           LORA["alpha"] / LORA["rank"])
    assert adapted == 2 * 2 + 1

    base = transformers.AutoModelForCausalLM.from_pretrained(setup["policy"], torch_dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, outs["adapter"]).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(outs["both"], torch_dtype=torch.float32).eval()
    ids = torch.randint(0, merged.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = with_adapter(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
