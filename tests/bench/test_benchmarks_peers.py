"""The posttrain-vs-TRL benchmark (native and transformers-backend sides) measures like with like: same data
conventions, same start, same counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
sys.path[:0] = [str(BENCH), *(str(d) for d in sorted(BENCH.glob("[a-z]*/")))]  # benchmarks/ and its groups

from peers_common import (  # noqa: E402
    EOS_ID,
    Settings,
    build_model_folder,
    model_config,
    parity_reward,
    preference_pairs,
    sft_documents,
    text,
    unshifted_labels,
)

TINY = ["--vocab", "256", "--hidden", "64", "--layers", "1", "--seq", "64", "--warmup", "1", "--steps", "1"]


def test_unshifted_labels_score_the_same_tokens():
    """posttrain's labels are shifted (position t predicts t + 1), transformers' are not: same (position, token) pairs."""
    ids, labels = sft_documents(Settings(seq=64, vocab=256), 20)
    for doc, aligned in zip(ids, labels):
        hf = np.array(unshifted_labels(doc, aligned))
        ours = {(t, int(y)) for t, y in enumerate(aligned) if y != -100}
        theirs = {(t - 1, int(y)) for t, y in enumerate(hf) if y != -100}  # HF shifts inside the model
        assert ours == theirs and ours
        assert all(doc[t + 1] == y for t, y in ours)


def test_parity_reward_reads_token_words():
    assert parity_reward("t4 t7 t10 t3", {}) == 0.5
    assert parity_reward("", {}) == 0.0
    assert parity_reward(text([4, 6, EOS_ID]), {}) == 1.0  # the eos word is not a token id


def test_tokenizer_maps_text_back_to_the_ids(tmp_path):
    """TRL's DPO/GRPO paths tokenize text: the word-level tokenizer must give back exactly the ids."""
    from transformers import AutoTokenizer

    from posttrain.tokenizer import Tokenizer

    s = Settings(vocab=256, hidden=64, layers=1, seq=64)
    folder = build_model_folder(model_config(s), tmp_path / "model")
    prompt, chosen, _ = preference_pairs(s, 1)[0]
    hf = AutoTokenizer.from_pretrained(str(folder))
    assert hf(text(prompt) + " " + text(chosen), add_special_tokens=False)["input_ids"] == prompt + chosen
    ours = Tokenizer(folder)
    assert ours.encode(text(prompt)) == prompt
    assert ours.pad_id == 0 and ours.eos_ids == [EOS_ID]


def test_parse_workloads():
    from run import parse_workloads

    assert parse_workloads("sft,dpo") == ["sft_padded", "sft_packed", "dpo"]
    with pytest.raises(SystemExit, match="unknown workload 'ppo'"):
        parse_workloads("sft,ppo")


def test_summary_ratios_and_targets():
    from run import summarize

    def run(side: str, seconds: float) -> dict:
        return {"side": side, "measures": "speed", "seconds": seconds, "steps": 3, "useful_tokens": 600,
                "losses": [1.0, 0.5]}

    def memory(side: str, peak: float, step: float) -> dict:  # its time and loss are not read
        return {"side": side, "measures": "memory", "seconds": 100.0, "steps": 3, "useful_tokens": 600,
                "peak_total_mib": peak, "peak_step_mib": step, "losses": [9.0]}

    rows = [memory("posttrain", 600, 100), memory("trl", 1000, 300), memory("posttrain", 650, 90),
            memory("trl", 900, 280), run("posttrain", 2.0), run("trl", 4.0), run("posttrain", 4.0), run("trl", 4.0),
            memory("posttrain-hf", 1300, 200), run("posttrain-hf", 12.0)]
    out = summarize("sft_packed", rows)
    assert out["posttrain"]["tokens_per_s"] == 1200 / 6 and out["trl"]["tokens_per_s"] == 1200 / 8
    assert out["ratios"]["tokens_per_s"] == pytest.approx(8 / 6)  # below 1.5: missed
    assert out["ratios"]["peak_total"] == 0.65 and out["ratios"]["peak_step"] == pytest.approx(100 / 300)
    assert out["posttrain"]["final_loss"] == 0.5  # from the first speed run
    assert out["targets"] == {"tokens_per_s": False, "memory (process)": True, "memory (training)": True}
    assert summarize("grpo", rows)["targets"]["steps_per_s"] is True  # DPO/GRPO: steps/s >= 1.0
    assert out["fallback"]["vs_native"]["tokens_per_s"] == pytest.approx((600 / 12) / (1200 / 6))
    assert out["fallback"]["vs_trl"]["peak_total"] == 1.3 and out["fallback"]["vs_native"]["peak_step"] == 2.0


@pytest.mark.slow
def test_both_sides_start_equal_and_count_the_same_tokens(tmp_path):
    """One tiny run of every workload: identical start, data and optimizer give the same SFT (padded) and DPO losses."""
    out = tmp_path / "peers.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers" / "run.py"), *TINY, "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    summary = {row["workload"]: row for row in result["summary"]}
    assert set(summary) == {"sft_padded", "sft_packed", "dpo", "grpo"}
    assert {r["measures"] for r in result["runs"]} == {"speed", "memory"}
    runs = {(r["workload"], r["side"]): r for r in result["runs"] if r["measures"] == "speed"}
    for workload in ("sft_padded", "dpo"):  # same batches on every side
        ours, trl = runs[(workload, "posttrain")], runs[(workload, "trl")]
        assert ours["useful_tokens"] == trl["useful_tokens"] == runs[(workload, "posttrain-hf")]["useful_tokens"] > 0
        assert ours["losses"] == pytest.approx(trl["losses"], rel=1e-4)
    for workload in ("sft_padded", "sft_packed", "dpo"):  # the same model on transformers' code: the same losses
        assert runs[(workload, "posttrain-hf")]["losses"] == pytest.approx(runs[(workload, "posttrain")]["losses"], rel=1e-4)
    for row in summary.values():
        for side in ("posttrain", "posttrain-hf", "trl"):
            assert row[side]["tokens_per_s"] > 0 and row[side]["peak_total_mib"] > row[side]["peak_step_mib"] > 0
        assert row["ratios"]["tokens_per_s"] > 0 and row["fallback"]["vs_native"]["tokens_per_s"] > 0
    assert "posttrain / TRL (this run)" in proc.stdout and "the transformers backend (posttrain-hf)" in proc.stdout
    table = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peers" / "run.py"), "--table", str(out)],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert f"| GRPO | posttrain | {summary['grpo']['posttrain']['tokens_per_s']:,.1f} |" in table
    assert table.count("| posttrain-hf / posttrain |") == 4
    foreign = {"posttrain": {"transformers", "trl", "accelerate"}, "posttrain-hf": {"trl"}, "trl": {"posttrain"}}
    for run in result["runs"]:  # each run's process holds its own side's libraries only
        assert not foreign[run["side"]] & set(run["libraries"]), run
    assert all("transformers" in r["libraries"] for r in result["runs"] if r["side"] == "posttrain-hf")
