"""`<stage>.epochs` in place of `steps`: the steps come from the training split's size when the stage starts, and
the schedule, the metrics and the summary follow them."""

from __future__ import annotations

import json
import math
from pathlib import Path

from posttrain.data.store import load_split
from posttrain.rl.prompts import prompt_count
from sft_testing import metrics, prepare_data, resolved_config, run_sft


def test_sft_epochs_set_the_steps_from_the_packed_split(tmp_path: Path) -> None:
    data = prepare_data(tmp_path, {"n_sft": 120, "n_eval": 8})
    rows = len(load_split(data, "sft"))
    cfg = resolved_config("sft", "epochs", sft={"steps": 1000, "epochs": 1.5, "batch_size": 8, "warmup_steps": 1,
                                                "checkpoint_every": 1000, "log_every": 1000})
    cfg["model"]["policy"] = "tiny-student"
    out = tmp_path / "out"
    run_sft(cfg, data, out)
    steps = math.ceil(1.5 * rows / 8)
    assert 1 < steps < 1000  # the split, not `steps`, decided
    records = metrics(out)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1))
    lrs = [r["lr"] for r in records if "lr" in r]
    assert lrs[-1] < lrs[1]  # the cosine schedule reaches its end at the computed last step
    summary = json.loads((out / "posttrain.json").read_text())["metrics"]
    assert summary["steps"] == steps and summary["train_rows"] == rows
    assert summary["epochs"] == round(steps * 8 / rows, 4) >= 1.5


def test_grpo_counts_the_prompts_it_draws_from(tmp_path: Path) -> None:
    data = prepare_data(tmp_path, {"n_prompts": 24, "n_sft": 16, "n_eval": 8})
    assert prompt_count(str(data), None) == len(load_split(data, "prompts")) == 24
