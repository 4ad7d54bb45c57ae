"""The SFT stage end to end: it learns the default task, FSDP2 / TP runs match one process, LoRA and
QLoRA export merged weights plus PEFT adapters, metrics are logged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.model_files import load_hf_model, read_safetensors
from posttrain.data.loader import prompt_batches
from posttrain.generation import SamplingParams, generate
from posttrain.models.lora import dequantize
from posttrain.rewards.verifiers import task_verifier
from posttrain.tokenizer import Tokenizer
from posttrain.training.checkpointer import resume_dir
from posttrain.training.setup import initial_state
from posttrain.utils.metrics import LoggerUnavailableError, MetricsLogger, truncate_after
from sft_testing import SMALL_DATA, SMALL_SFT, metrics, prepare_data, resolved_config, run_sft, train_losses, weights

# What the learning test trains: the built-in `reverse` task, which the distillation-student preset
# learns within a test's budget (measured: 47% of held-out prompts right after 300 steps, 96% after
# 400); the default tasks (2-digit arithmetic, 5-number sort) need far more steps than a test has.
LEARN_DATA = {**SMALL_DATA, "tasks": [{"name": "reverse", "length": 3, "max_value": 20}], "n_sft": 1200, "n_eval": 100}
LEARN_SFT = {"steps": 300, "batch_size": 16, "lr": 3.0e-3, "warmup_steps": 10, "checkpoint_every": 1000,
             "log_every": 100}
MIN_ACCURACY = 0.2


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return prepare_data(tmp_path_factory.mktemp("sft-data"))


def _config(key: str, sft: dict | None = None, **sections) -> dict:
    return resolved_config("sft", key, data=SMALL_DATA, sft={**SMALL_SFT, **(sft or {})}, **sections)


def task_accuracy(model_dir: Path, data_dir: Path, limit: int = 100) -> float:
    """Share of held-out task prompts the model answers correctly with greedy decoding."""
    model = load_hf_model(model_dir).eval()
    tok = Tokenizer(model_dir)
    batch = next(prompt_batches(data_dir, limit, seed=0, split="eval", shuffle=False, loop=False))
    out = generate(model, batch["prompt_ids"], SamplingParams(max_new_tokens=24, stop_token_ids=tok.eos_ids),
                   pad_id=tok.pad_id)
    completions = tok.decode_batch(out.tokens)
    return sum(task_verifier(c, ex) for c, ex in zip(completions, batch["examples"])) / len(completions)


@pytest.mark.slow
def test_sft_lowers_held_out_loss_and_learns_the_task(tmp_path):
    data = prepare_data(tmp_path, LEARN_DATA)
    out = tmp_path / "sft"
    cfg = resolved_config("sft", "learn", data=LEARN_DATA, sft=LEARN_SFT, model={"policy": "tiny-student"})
    run_sft(cfg, data, out)

    summary = json.loads((out / "posttrain.json").read_text())["metrics"]
    assert summary["eval_loss_after"] < 0.5 * summary["eval_loss_before"]
    records = metrics(out)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_mb", "loss_tokens"} <= records[1].keys()
    assert len(train_losses(records)) == LEARN_SFT["steps"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    assert not resume_dir(out).exists()
    assert task_accuracy(out, data) >= MIN_ACCURACY


@pytest.fixture(scope="module")
def one_process(data_dir, tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("one") / "sft"
    run_sft(_config("parallel", {"steps": 5, "checkpoint_every": 1000}), data_dir, out)
    return train_losses(metrics(out))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "name, sft, parallel",
    [
        # Same global batch of 8 rows: 2 ranks x 2 micro-batches x 2 rows.
        ("fsdp2-accum2", {"grad_accum": 2}, {"tp": 1}),
        ("tp2-loss-parallel", {}, {"tp": 2}),
        ("cp2-packed-rows", {}, {"cp": 2}),  # both ranks read the 8 rows, each holds half of every row
    ],
)
def test_two_processes_match_one(name, sft, parallel, data_dir, one_process, tmp_path):
    out = tmp_path / "sft"
    cfg = _config("parallel", {"steps": 5, "checkpoint_every": 1000, **sft}, parallel=parallel)
    run_sft(cfg, data_dir, out, nproc=2)
    losses = train_losses(metrics(out))
    assert len(losses) == len(one_process) == 5
    for a, b in zip(losses, one_process):
        assert abs(a - b) <= 1e-5 * abs(b), (name, losses, one_process)


@pytest.mark.slow
@pytest.mark.distributed
def test_memory_features_under_context_parallelism_match_one_process(data_dir, tmp_path):
    """Activation checkpointing and the optimizer stepping in backward (no clipping) with each row split over
    two ranks: the losses of one process with the same memory settings."""
    memory = {"activation_checkpointing": 1, "optimizer_in_backward": True}
    sft = {"steps": 4, "checkpoint_every": 1000, "max_grad_norm": None}
    run_sft(_config("mem-one", sft, memory=memory), data_dir, tmp_path / "one")
    run_sft(_config("mem-cp", sft, memory=memory, parallel={"cp": 2}), data_dir, tmp_path / "cp", nproc=2)
    one, cp = train_losses(metrics(tmp_path / "one")), train_losses(metrics(tmp_path / "cp"))
    assert len(one) == 4 and cp == pytest.approx(one, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_lora_export_merges_adapters_and_writes_peft(method, data_dir, tmp_path):
    out = tmp_path / "sft"
    lora = {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": ["q_proj", "v_proj", "down_proj"]}
    cfg = _config(method, {"method": method, "steps": 3, "lr": 1e-2, "checkpoint_every": 1000, "lora": lora})
    run_sft(cfg, data_dir, out)

    merged = weights(out)
    adapter = read_safetensors([out / "adapter" / "adapter_model.safetensors"])
    adapter_cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 4 and adapter_cfg["peft_type"] == "LORA"
    assert sorted(adapter_cfg["target_modules"]) == ["down_proj", "q_proj", "v_proj"]

    hf_config = json.loads((out / "config.json").read_text())
    base = initial_state(cfg["model"]["policy"], hf_config, cfg["seed"])
    scale = lora["alpha"] / lora["rank"]
    targeted = 0
    for name, weight in merged.items():
        module = name.removesuffix(".weight")
        a = adapter.get(f"base_model.model.{module}.lora_A.weight")
        if a is None:
            assert torch.equal(weight, base[name]), f"{name} is frozen and untargeted but changed"
            continue
        targeted += 1
        b = adapter[f"base_model.model.{module}.lora_B.weight"]
        assert b.abs().max() > 0, "lora_B never trained"
        delta = scale * b @ a
        if method == "lora":
            torch.testing.assert_close(weight, base[name] + delta, rtol=1e-5, atol=1e-6)
        else:  # the base was trained in NF4: merged = dequantized base + delta
            from torchao.quantization import to_nf4

            torch.testing.assert_close(weight, dequantize(to_nf4(base[name])) + delta, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(weight, base[name] + delta, atol=1e-6)
    assert targeted == 3 * hf_config["num_hidden_layers"]


def test_metrics_logger_writes_jsonl_truncates_and_explains_missing_loggers(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLogger(path)
    for step in range(1, 5):
        log.log(step, {"loss": 1.0 / step})
    log.close()
    truncate_after(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert not MetricsLogger(tmp_path / "other.jsonl", enabled=False).path.exists()

    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    with pytest.raises(LoggerUnavailableError, match="asks for 'wandb' but the package 'wandb' is not installed"):
        MetricsLogger(path, loggers=["wandb"])
    with pytest.raises(ValueError, match="unknown logger 'neptune'"):
        MetricsLogger(path, loggers=["neptune"])
