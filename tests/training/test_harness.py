"""The training-stage harness and what it shares: the output head's two paths agree, the optimizer
step's rules (gradient scale, skip, stop), the resume log, stage inputs named as the plan names
them, and the reward stage resuming its sampling after a kill."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from posttrain.model_files import save_hf_model
from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.losses.head import OutputHead, summed_lm_loss
from posttrain.models import Transformer, document_positions, preset_config
from posttrain.tokenizer import Tokenizer
from posttrain.training.faults import KILL_AT_STEP_ENV, NonFiniteLossError
from posttrain.training.optimization import Optimization
from posttrain.training.checkpointer import resume_dir
from posttrain.training.result_log import ResultLog
from posttrain.utils.provenance import write_provenance
from posttrain.workflow.schema import load_config
from posttrain.workflow.plan import build_plan
from sft_testing import env_for, prepare_data, resolved_config, write_config

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 97
CHUNKED = {"chunked_ce": True, "ce_chunks": 3}
FULL = {"chunked_ce": False, "ce_chunks": 3}


def _model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(preset_config("tiny-student", vocab_size=VOCAB))


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 20), generator=g)
    documents = torch.tensor([[0] * 8 + [1] * 12, [0] * 20])
    labels = torch.roll(ids, -1, dims=1)
    labels[:, :5] = IGNORE_INDEX
    labels[0, 7] = IGNORE_INDEX  # each document's last position
    labels[:, -1] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "document_ids": documents, "position_ids": document_positions(documents)}


def test_the_output_heads_chunked_and_full_logit_paths_agree():
    model, batch = _model(), _batch()
    chunked, full = OutputHead(model, None, CHUNKED), OutputHead(model, None, FULL)
    assert not chunked.full_logits and full.full_logits
    ce = [summed_lm_loss(model, head, batch) for head in (chunked, full)]
    torch.testing.assert_close(ce[0], ce[1], rtol=1e-5, atol=1e-5)
    grads = [torch.autograd.grad(loss, list(model.parameters())) for loss in ce]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

    hidden = model(batch["input_ids"]).detach()
    sums = [head.sequence_logprobs(hidden, batch["labels"]) for head in (chunked, full)]
    torch.testing.assert_close(sums[0][0], sums[1][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(sums[0][1], sums[1][1]) and sums[0][1].tolist() == [13, 14]

    mask = batch["labels"] != IGNORE_INDEX
    (lp_c, ent_c), (lp_f, ent_f) = (head.token_logprobs_and_entropy(hidden, batch["labels"], mask, temperature=0.7)
                                    for head in (chunked, full))
    torch.testing.assert_close(lp_c, lp_f, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_c, ent_f, rtol=1e-5, atol=1e-5)
    # Against an independent computation: log-softmax of the whole logits at temperature 0.7.
    logp = torch.log_softmax(model.lm_head(hidden).double() / 0.7, dim=-1)
    expected = logp.gather(-1, batch["labels"].clamp(min=0)[..., None])[..., 0] * mask
    torch.testing.assert_close(lp_f.double(), expected, rtol=1e-5, atol=1e-5)
    assert chunked.chunking() == {"num_chunks": 3, "checkpoint_chunks": None}
    assert full.chunking() == {"num_chunks": 1, "checkpoint_chunks": False}


def _section(**values) -> dict:
    return {"lr": 0.1, "steps": 10, "warmup_steps": 0, "min_lr_ratio": 1.0, "max_grad_norm": None,
            "skip_nonfinite": 1, **values}


def test_backward_divides_by_the_steps_count():
    memory = load_config(ROOT / "config" / "config.yaml")["memory"]
    model = torch.nn.Linear(3, 1, bias=False)
    optimization = Optimization(model, _section(), memory, None, "sft")
    x = torch.tensor([[1.0, 2.0, 3.0]])
    optimization.backward(model(x).sum(), per=4)
    torch.testing.assert_close(model.weight.grad, x / 4)


def test_a_nonfinite_loss_skips_the_step_then_stops_the_stage():
    memory = load_config(ROOT / "config" / "config.yaml")["memory"]
    model = torch.nn.Linear(3, 1, bias=False)
    optimization = Optimization(model, _section(), memory, None, "sft", lambda: Path("ckpt/step-00000004"))
    before = model.weight.detach().clone()
    optimization.backward(model(torch.ones(1, 3)).sum())
    record = optimization.step(5, math.nan)
    assert record["skipped"] == 1 and torch.equal(model.weight, before) and model.weight.grad is None
    optimization.backward(model(torch.ones(1, 3)).sum())
    record = optimization.step(6, 1.0)
    assert "skipped" not in record and not torch.equal(model.weight, before) and record["lr"] == 0.1
    with pytest.raises(NonFiniteLossError, match=r"step 7: .*sft.skip_nonfinite.*ckpt/step-00000004"):
        optimization.step(7, math.inf)


def test_the_result_log_keeps_finished_items_of_this_key_only(tmp_path):
    out = tmp_path / "reward"
    log = ResultLog(out, "samples.jsonl", "key-a")
    log.add(0, [[1, 2], [-0.5, -0.25], ["stop"]])
    log.add(1, [[3], [-1.0], ["length"]])
    with log.path.open("a") as f:
        f.write('{"item": 2, "resu')  # a write cut short by a kill
    again = ResultLog(out, "samples.jsonl", "key-a")
    assert again.done == {0: [[1, 2], [-0.5, -0.25], ["stop"]], 1: [[3], [-1.0], ["length"]]}
    again.add(2, [[4], [-2.0], ["stop"]])
    assert sorted(ResultLog(out, "samples.jsonl", "key-a").done) == [0, 1, 2]
    assert ResultLog(out, "samples.jsonl", "key-b").done == {}  # another configuration's log is not used
    assert log.path.parent == resume_dir(out)


def _inputs(stage: str) -> set[str]:
    """The keys of a stage script's INPUTS literal (read like READS: without importing the script)."""
    for node in ast.parse((ROOT / "stages" / f"{stage}.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "INPUTS" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"stages/{stage}.py declares no INPUTS")


def test_each_stage_declares_the_inputs_the_plan_gives_it():
    """Every flag the plan names a job's inputs by (which `stage_args` passes as `--<flag> <path>`) is in its
    script's INPUTS: the training stages, every evaluation, the export, and prepare_data (no inputs)."""
    cfg = load_config(ROOT / "config" / "config.yaml")
    cfg["reward_model"]["source"] = "train"
    variant = build_plan(cfg).variants["default"]
    jobs = variant.jobs()
    assert {job.stage for job in jobs} == {"prepare_data", "sft", "dpo", "reward_model", "reward", "grpo", "distill",
                                           "evaluate", "export"}
    assert len(variant.evals) == 4  # one evaluation per model stage
    for job in jobs:
        given = set(job.inputs)
        assert given <= _inputs(job.stage), (job.stage, given, _inputs(job.stage))
        if job.stage in ("sft", "dpo", "reward_model", "reward", "grpo", "distill", "evaluate"):
            assert "data" in given, (job.stage, given)
    assert set(variant.stages["prepare_data"].inputs) == _inputs("prepare_data") == set()
    assert set(variant.export.inputs) == {"model", "eval"}


def _policy(tmp: Path, data: Path) -> Path:
    tok = Tokenizer(data / "tokenizer")
    hf = preset_config("tiny-student", vocab_size=tok.vocab_size, pad_token_id=tok.pad_id, eos_token_id=tok.eos_id)
    torch.manual_seed(0)
    folder = tmp / "policy"
    save_hf_model(Transformer(hf).state_dict(), hf, folder)
    tok.save(folder)
    write_provenance(folder, {"key": "policy-key"}, "dpo", 0.0, {})
    return folder


def test_the_reward_stage_resumes_its_sampling_after_a_kill(tmp_path):
    """Two sampling calls (32 prompts each at 2 samples per prompt); killed after the first, the rerun
    samples only the second and writes exactly the output of an uninterrupted run."""
    data = prepare_data(tmp_path, {"n_prompts": 40})
    policy = _policy(tmp_path, data)
    cfg = resolved_config("reward", "reward-resume", data={"n_prompts": 40},
                          reward={"n_prompts": 40, "samples_per_prompt": 2, "max_new_tokens": 6})
    config = write_config(cfg, tmp_path / "reward.json")

    def run(out: Path, **env: str) -> subprocess.CompletedProcess:
        command = [sys.executable, str(ROOT / "stages" / "reward.py"), "--config", str(config), "--data", str(data),
                   "--model", str(policy), "--out", str(out)]
        return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env_for(**env))

    whole = run(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = run(tmp_path / "resumed", **{KILL_AT_STEP_ENV: "1"})
    assert killed.returncode == -9 and not (tmp_path / "resumed").exists()
    assert len((resume_dir(tmp_path / "resumed") / "samples.jsonl").read_text().splitlines()) == 2  # header, call 0
    resumed = run(tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not resume_dir(tmp_path / "resumed").exists()
    for name in ("rollouts.parquet", "grpo_prompts.parquet"):
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "whole" / name),
                                      pd.read_parquet(tmp_path / "resumed" / name))
    assert (tmp_path / "whole" / "pairs.jsonl").read_bytes() == (tmp_path / "resumed" / "pairs.jsonl").read_bytes()
    stats = [json.loads((tmp_path / d / "stats.json").read_text()) for d in ("whole", "resumed")]
    assert stats[0] == stats[1] and stats[0]["rollouts"] == 80


def test_the_reward_stage_refuses_several_processes(tmp_path):
    cfg = resolved_config("reward", "reward-two")
    config = write_config(cfg, tmp_path / "reward.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               str(ROOT / "stages" / "reward.py"), "--config", str(config), "--data", str(tmp_path / "data"),
               "--model", str(tmp_path / "policy"), "--out", str(tmp_path / "out")]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env_for())
    assert proc.returncode != 0
    assert "reward: error: reward runs as one process, but was started as 2" in proc.stderr, proc.stderr[-2000:]


def test_held_out_log_probs_agree_on_both_paths():
    model, batch = _model(), _batch()
    hidden = model(batch["input_ids"]).detach()
    kept = [OutputHead(model, None, memory).kept_token_logprobs(hidden, batch["labels"]) for memory in (CHUNKED, FULL)]
    assert kept[0].shape == (27,)
    torch.testing.assert_close(kept[0], kept[1], rtol=1e-5, atol=1e-5)
