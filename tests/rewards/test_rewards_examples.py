"""Every shipped example config, with local stand-ins for what it takes from the hub (a tiny model folder for
its model, a few rows shaped like its datasets for its data sources, small counts): planned, its data prepared
and its evaluation run with its own verifiers, from the resolved configs its plan writes. The Qwen3 GSM8K
example's evaluation scores GSM8K's `#### N` answers (with `task` it would fail at its first evaluation)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import posttrain.generation.backend
from eval_fixtures import run_stage, write_config
from posttrain.model_files import save_hf_model
from posttrain.data.store import load_split
from posttrain.generation import GenerationOutput
from posttrain.models import Transformer, is_preset, preset_config
from posttrain.tokenizer import Tokenizer, train_bpe_tokenizer
from posttrain.utils.provenance import write_provenance
from posttrain.workflow.plan import build_plan
from posttrain.workflow.schema import ConfigError, load_config, load_yaml, validate_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p.name for p in (ROOT / "config" / "examples").glob("*.yaml"))
QWEN3 = "qwen3-0.6b-8gpu.yaml"
COUNTS = 6  # rows per kind
# GSM8K rows as the hub has them: `question`, and `answer` = a worked solution ending in "#### <number>".
GSM8K = [{"question": f"Tom has {a} apples and buys {b} more boxes of {c}. How many apples does he have?",
          "answer": f"He buys {b} * {c} = <<{b}*{c}={b * c}>>{b * c} apples.\nSo he has {a} + {b * c} = "
                    f"<<{a}+{b * c}={a + b * c}>>{a + b * c} apples.\n#### {a + b * c:,}"}
         for a, b, c in [(3, 2, 5), (10, 4, 25), (7, 30, 40), (1, 9, 9), (12, 6, 200), (5, 5, 5), (8, 1, 2), (2, 3, 4)]]
# argilla/distilabel-math-preference-dpo's columns
MATH_PREFERENCE = [{"instruction": f"What is {i} + {i}?", "chosen_response": f"{i} + {i} = {2 * i}.",
                    "rejected_response": f"{i} + {i} = {2 * i + 1}."} for i in range(8)]
SHAPES = {"openai/gsm8k": GSM8K, "argilla/distilabel-math-preference-dpo": MATH_PREFERENCE}


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, Any]:
    """A tiny Qwen3 folder (BPE tokenizer with a ChatML template, random weights) and local copies of the
    hub datasets the examples name, shaped like them."""
    tmp = tmp_path_factory.mktemp("examples")
    model = tmp / "tiny-model"
    texts = [r["question"] + " " + r["answer"] for r in GSM8K] + [f"{i} + {j} = {i + j}" for i in range(30) for j in range(9)]
    tok = train_bpe_tokenizer(texts, 300, model)
    hf = preset_config("tiny", tok.vocab_size, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    hf.update(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16)
    torch.manual_seed(0)
    save_hf_model(Transformer(hf).state_dict(), hf, model)
    write_provenance(model, {"key": "stand-in", "upstream": {}}, "sft", 0.0, {})  # as a trained stage leaves it
    files = {}
    for hub_id, rows in SHAPES.items():
        files[hub_id] = tmp / f"{hub_id.replace('/', '--')}.jsonl"
        files[hub_id].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"tmp": tmp, "model": model, "files": files}


def local_config(name: str, stand_ins: dict[str, Any], results: Path) -> dict[str, Any]:
    """The example over config/config.yaml with its hub inputs replaced by the stand-ins and small counts."""
    overlay = load_yaml(ROOT / "config" / "examples" / name)
    cfg = load_config(ROOT / "config" / "config.yaml", ROOT / "config" / "examples" / name)
    for key in ("policy", "student"):
        if cfg["model"][key] and not is_preset(cfg["model"][key]):
            cfg["model"][key] = str(stand_ins["model"])
    for source in cfg["data"]["sources"]:
        if (ROOT / source["path"]).is_file():  # a file the repository ships (the tool-use demonstrations)
            source["path"] = str(ROOT / source["path"])
            continue
        # same kind and columns, a local file (which holds one split and no subsets)
        source.update(path=str(stand_ins["files"][source["path"]]), subset=None, split=None)
    for kind in ("n_sft", "n_preference", "n_prompts", "n_eval"):
        cfg["data"][kind] = min(cfg["data"][kind], COUNTS)
    cfg["eval"].update(n_prompts=4, max_new_tokens=8, lm_eval_tasks=[])
    cfg["results"] = str(results)
    if cfg["ablations"]:
        cfg["ablations"] = str(ROOT / cfg["ablations"])
    assert overlay.get("reward", {}).get("verifiers", cfg["reward"]["verifiers"]) == cfg["reward"]["verifiers"]
    return validate_config(cfg, where=name)


def run_job(job, argv: list, monkeypatch) -> Path:
    """The planned job's stage in this process, with the resolved config and run settings its plan writes."""
    config = write_config(Path(job.config_path), job.resolved)
    write_config(Path(job.run_path), job.run)
    out = Path(job.path)
    run_stage(job.stage, ["--config", config, *argv, "--out", out], monkeypatch)
    return out


class GradedAnswers:
    """A backend that answers the eval rows with even index by their reference's '#### N' line (as GSM8K writes
    it, thousands separators included) and the others with a wrong number."""

    version = 0

    def __init__(self, data: Path):
        rows = load_split(data, "eval").to_list()
        self.index = {tuple(r["prompt_ids"]): (i, r["answer"]) for i, r in enumerate(rows)}
        self.tok = Tokenizer(data / "tokenizer")

    def generate(self, prompts, params, seed):
        texts = []
        for p in prompts:
            i, answer = self.index[tuple(p)]
            texts.append(answer.splitlines()[-1] if i % 2 == 0 else "#### -1")
        tokens = [self.tok.encode(t) + [self.tok.eos_id] for t in texts]
        return GenerationOutput(tokens, [[-1.0] * len(t) for t in tokens], ["stop"] * len(tokens))


def _model_for(data: Path, cfg: dict[str, Any], stand_ins: dict[str, Any], tmp_path: Path) -> Path:
    """The stand-in model, or for a preset policy a random one on the tokenizer data prep trained (a stand-in of
    another vocabulary would read out of its embedding)."""
    if not is_preset(cfg["model"]["policy"]):
        return stand_ins["model"]
    tok = Tokenizer(data / "tokenizer")
    hf = preset_config(cfg["model"]["policy"], tok.vocab_size, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    torch.manual_seed(0)
    save_hf_model(Transformer(hf).state_dict(), hf, tmp_path / "preset-model")
    write_provenance(tmp_path / "preset-model", {"key": "stand-in", "upstream": {}}, "sft", 0.0, {})
    return tmp_path / "preset-model"


@pytest.mark.parametrize("name", EXAMPLES)
def test_shipped_example_plans_prepares_data_and_evaluates(name, stand_ins, tmp_path, monkeypatch):
    results = tmp_path / "results"
    cfg = local_config(name, stand_ins, results)
    plan = build_plan(cfg)
    variant = next(iter(plan.variants.values()))
    data = run_job(variant.stages["prepare_data"], [], monkeypatch)
    assert len(load_split(data, "eval")) >= 4
    stage, job = next(iter(variant.evals.items()))
    if name == QWEN3:
        assert load_split(data, "eval").to_list()[0]["answer"].endswith("apples.\n#### 13")  # the worked solution, kept whole
        monkeypatch.setattr(posttrain.generation.backend, "NativeBackend", lambda *a, **k: GradedAnswers(data))
    model = [] if stage == "base" else ["--model", _model_for(data, cfg, stand_ins, tmp_path)]
    out = run_job(job, ["--data", data, *model], monkeypatch)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["verifiers"] == cfg["reward"]["verifiers"] and metrics["n_prompts"] == min(4, COUNTS)
    if name == QWEN3:
        assert metrics["verifiers"] == ["math"]
        assert metrics["accuracy"] == 0.5 and metrics["reward"] == 0.5  # even rows right, "#### 1,207" among them
        assert metrics["pass@1"] == 0.5


def test_the_gsm8k_example_with_the_task_verifier_is_refused_by_the_dry_run(stand_ins, tmp_path):
    cfg = local_config(QWEN3, stand_ins, tmp_path / "results")
    bad = copy.deepcopy(cfg)
    bad["reward"]["verifiers"] = ["task"]
    with pytest.raises(ConfigError, match=r"reward.verifiers\[0\]: task scores rows of the built-in tasks .* use math"):
        validate_config(bad)
