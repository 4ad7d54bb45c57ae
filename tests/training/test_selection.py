"""Evaluation during training (`eval_every`, `keep: best`, `early_stopping`): the rule on its own, then an SFT run
whose held-out loss rises after its second step (a constant, too-high learning rate): the output holds the weights
of the best evaluation (its held-out loss recomputed by transformers from the output folder is that evaluation's,
not the last one's), the run stops at the patience limit, and a run killed after its best and its first checkpoint
resumes to the same files, bitwise."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain.data.store import load_split
from posttrain.rules import selection_problems
from posttrain.training.checkpointer import resume_dir
from posttrain.training.faults import KILL_AT_STEP_ENV
from posttrain.training.selection import Selection
from sft_testing import metrics, prepare_data, resolved_config, run_sft, weights
from test_reliability import results_without_timing

EVERY, PATIENCE = 2, 3
SFT = {"steps": 16, "batch_size": 8, "warmup_steps": 0, "lr": 0.03, "schedule": "constant", "checkpoint_every": 4,
       "log_every": 100, "eval_every": EVERY, "keep": "best", "early_stopping": {"patience": PATIENCE, "min_delta": 0.0}}


def test_the_best_evaluation_and_the_patience_count():
    loss = Selection("eval_loss", "min", min_delta=0.1, patience=2)
    assert [loss.update(s, {"eval_loss": v}) for s, v in [(2, 3.0), (4, 2.5), (6, 2.45), (8, float("nan"))]] == \
        [True, True, False, False]  # 2.45 beats 2.5 by less than min_delta; NaN never improves
    assert (loss.best, loss.best_step, loss.since_best) == (2.5, 4, 2) and loss.should_stop()
    accuracy = Selection("eval_accuracy", "max")
    assert [accuracy.update(s, {"eval_accuracy": v}) for s, v in [(1, 0.2), (2, 0.2), (3, 0.3)]] == [True, False, True]
    assert not accuracy.should_stop()  # patience 0: never
    restored = Selection("eval_loss", "min", 0.1, 2)
    restored.load_state_dict(loss.state_dict())
    assert restored == loss
    with pytest.raises(KeyError, match="not the selection metric 'eval_loss'"):
        loss.update(10, {"loss": 1.0})


def test_the_dry_run_rule_names_the_key():
    section = {"steps": 10, "eval_every": 0, "keep": "best", "metric": None, "early_stopping": {"patience": 2}}
    assert [key for key, _ in selection_problems("sft", section)] == ["sft.keep", "sft.early_stopping.patience"]
    assert selection_problems("dpo", {**section, "eval_every": 20})[0] == (
        "dpo.eval_every", "20 is more than dpo.steps (10): the stage would evaluate only after training")
    (key, why), = selection_problems("dpo", {**section, "eval_every": 5, "metric": "eval_loss"})
    assert key == "dpo.metric" and "eval_pref_acc, eval_pref_margin, eval_likelihood_acc" in why


def _transformers_eval_loss(model_dir: Path, data: Path) -> float:
    """The held-out loss of an output folder, by transformers: CE over the sft_eval rows' labels per label token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = load_split(data, "sft_eval")[np.arange(len(load_split(data, "sft_eval")))]
    ids, labels = (torch.tensor(np.array(rows[k]), dtype=torch.long) for k in ("input_ids", "labels"))
    with torch.no_grad():
        logits = model(ids).logits
    total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return float(total) / int((labels != -100).sum())


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    # One conversation a row (no packing), so the transformers pass needs no per-document attention.
    return prepare_data(tmp_path_factory.mktemp("selection-data"), {"n_sft": 200, "n_eval": 20, "packing": False})


def test_keep_best_and_early_stopping_survive_a_kill(data, tmp_path):
    cfg = resolved_config("sft", "selection", sft=SFT)
    straight = tmp_path / "straight"
    run_sft(cfg, data, straight)
    records = metrics(straight)
    evaluations = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r and r["step"] > 0}
    best = min(evaluations, key=evaluations.get)
    last = max(evaluations)
    summary = json.loads((straight / "posttrain.json").read_text())["metrics"]
    # the run stopped once PATIENCE evaluations in a row had not beaten the best, and not before
    assert last == best + PATIENCE * EVERY < SFT["steps"], evaluations
    assert all(evaluations[s] >= evaluations[best] for s in evaluations)
    assert sorted(evaluations) == list(range(EVERY, last + 1, EVERY))
    assert max(r["step"] for r in records if "loss" in r) == last == summary["steps"] and summary["stopped_early"]
    assert summary["best_step"] == best and summary["eval_loss_after"] == evaluations[best]
    # the output holds the best evaluation's weights, not the last step's
    recomputed = _transformers_eval_loss(straight, data)
    assert recomputed == pytest.approx(evaluations[best], abs=1e-4)
    assert abs(evaluations[last] - evaluations[best]) > 0.1

    # killed after step 5: the best (step 2) and a checkpoint (step 4) are on disk; the resumed run ends the same
    killed = tmp_path / "killed"
    proc = run_sft(cfg, data, killed, check=False, **{KILL_AT_STEP_ENV: "5"})
    assert proc.returncode == -signal.SIGKILL
    assert sorted(p.name for p in resume_dir(killed).iterdir() if p.is_dir()) == [f"best-{best:08d}", "step-00000004"]
    resumed = run_sft(cfg, data, killed)
    assert "resuming from" in resumed.stdout and "at step 4" in resumed.stdout
    a, b = weights(straight), weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert results_without_timing(metrics(killed)) == results_without_timing(records)
    assert not resume_dir(killed).exists()
