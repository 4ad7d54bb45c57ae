"""The DPO stage end to end on a quickly SFT-trained tiny model: learning on the default tasks without
collapse, online == precomputed reference, on-policy pairs, resume after a kill, 2-process FSDP2 and TP."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.model_files import load_hf_model
from posttrain.data.loader import prompt_batches
from posttrain.data.tasks import make_splits
from posttrain.generation import SamplingParams, generate
from posttrain.rewards.verifiers import format_reward, task_verifier
from posttrain.rl.curation import write_pairs
from posttrain.tokenizer import Tokenizer
from posttrain.training.faults import KILL_AT_STEP_ENV
from sft_testing import ROOT, env_for, metrics, prepare_data, resolved_config, run_sft, weights, write_config

pytestmark = pytest.mark.slow  # every test here starts from a freshly SFT-trained model (the module fixture)

DPO_SCRIPT = ROOT / "stages" / "dpo.py"
POLICY = {"policy": "tiny-student"}  # the small preset keeps SFT + DPO to seconds
# The default tasks, sorting made short enough (3 digits) that a few seconds of SFT solve it: task accuracy
# then has room to collapse. Two-digit arithmetic stays unsolved; its pairs still carry preferences. SFT
# gets 600 distinct sorting problems: with 300 the model memorized them and any further step moved it.
DATA = {"tasks": [{"name": "arithmetic", "ops": ["add", "sub", "mul"], "digits": 2},
                  {"name": "sort", "length": 3, "max_value": 9}],
        "n_sft": 1200, "n_preference": 400, "n_prompts": 8, "n_eval": 100, "max_seq_len": 64}
SFT = {"steps": 300, "batch_size": 16, "lr": 2e-3, "warmup_steps": 5, "checkpoint_every": 1000, "log_every": 50}
DPO = {"steps": 60, "batch_size": 16, "lr": 5e-5, "beta": 0.5, "warmup_steps": 2, "checkpoint_every": 1000,
       "log_every": 20}
SHORT = {**DPO, "steps": 3, "batch_size": 8, "lr": 1e-3, "checkpoint_every": 1}  # the comparison runs
STEP_KEYS = {"loss", "rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin", "logps/chosen",
             "logps/rejected", "lr", "grad_norm", "tokens_per_s", "peak_memory_mb"}


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> tuple[Path, Path]:
    return sft_policy(tmp_path_factory.mktemp("dpo-stage"))


def sft_policy(tmp: Path, seed: int | None = None, threads: int = 1) -> tuple[Path, Path]:
    """(data dir, SFT model dir): the default tasks, a tiny model trained for a few seconds (the
    config's seed unless `seed` is given)."""
    data = prepare_data(tmp, DATA, seed=seed)
    cfg = resolved_config("sft", "dpo-test-sft", data=DATA, sft=SFT, model=POLICY)
    if seed is not None:
        cfg["seed"] = seed
    run_sft(cfg, data, tmp / "sft", OMP_NUM_THREADS=str(threads))
    return data, tmp / "sft"


def dpo_config(key: str, **dpo: Any) -> dict[str, Any]:
    cfg = resolved_config("dpo", key, data=DATA, sft=SFT, model=POLICY, dpo=dpo)
    cfg["upstream"] = {"prepare_data": "test-data", "sft": "dpo-test-sft"}
    return cfg


def run_dpo(cfg: dict[str, Any], data: Path, model: Path, out: Path, nproc: int = 1, check: bool = True,
            extra: tuple[str, ...] = (), **env: str) -> subprocess.CompletedProcess:
    config = write_config(cfg, out.parent / f"{out.name}.json")
    args = [str(DPO_SCRIPT), "--config", str(config), "--data", str(data), "--model", str(model), "--out", str(out),
            *extra]
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     "--nproc-per-node", str(nproc)]
    proc = subprocess.run([*launcher, *args], capture_output=True, text=True, cwd=ROOT, timeout=900,
                          env=env_for(threads=1, **env))
    if check and proc.returncode != 0:
        raise AssertionError(f"dpo exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "posttrain.json").read_text())["metrics"]


def greedy_scores(model_dir: Path, data: Path, n: int = 100) -> dict[str, float]:
    """Task accuracy and well-formed-answer rate of greedy completions of the first `n` eval prompts."""
    tok = Tokenizer(data / "tokenizer")
    batch = next(prompt_batches(data, n, seed=0, split="eval", shuffle=False, loop=False))
    model = load_hf_model(model_dir).eval()
    with torch.no_grad():
        out = generate(model, batch["prompt_ids"], SamplingParams(max_new_tokens=24, stop_token_ids=tok.eos_ids),
                       pad_id=tok.pad_id)
    texts = tok.decode_batch(out.tokens)
    return {
        "accuracy": sum(task_verifier(t, ex) for t, ex in zip(texts, batch["examples"])) / n,
        "format": sum(format_reward(t, ex) for t, ex in zip(texts, batch["examples"])) / n,
    }


def step_values(out: Path, key: str = "loss") -> list[float]:
    """`key` of every training step's record, in step order."""
    return [r[key] for r in metrics(out) if "loss" in r]


def mean(records: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in records) / len(records)


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp(min=1e-12)).item() for k in a)


def test_dpo_learns_held_out_preferences_without_collapse(sft, tmp_path):
    data, sft_dir = sft
    out = tmp_path / "dpo"
    run_dpo(dpo_config("dpo-e2e", **DPO), data, sft_dir, out)

    records = metrics(out)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, DPO["steps"] + 1))
    assert all(STEP_KEYS <= r.keys() for r in steps)
    # Policy == reference at step 1: log 2, plus the weighted NLL of the chosen responses (RPO term).
    weight = dpo_config("dpo-e2e", **DPO)["dpo"]["chosen_nll_weight"]
    assert steps[0]["loss"] == pytest.approx(0.6931 + weight * steps[0]["nll/chosen"], abs=1e-3)
    first, last = steps[:10], steps[-10:]
    assert mean(last, "loss") < mean(first, "loss") - 0.05
    assert mean(last, "rewards/margin") > mean(first, "rewards/margin")

    s = summary(out)
    assert s["pref_pairs"] == 100 and s["reference"] == "precompute"
    # Margins from `python benchmarks/quality/learning_spread.py dpo` (seeds 1234, 1, 2 x 1 and 2 threads, AMD
    # EPYC with AVX-512, 2026-12-01): pref_acc 0.74-0.79, likelihood_acc minus the SFT model's -0.00 to
    # +0.02, SFT greedy accuracy 0.34-0.42, DPO / SFT accuracy 0.91-1.00, format 0.99-1.00. (The SFT
    # lr was 5e-3 before: one seed in three then sat on the plateau, 0.07 accuracy, and on a Xeon
    # DPO kept 0.74 of it.) One and two threads gave identical runs on that machine.
    # The SFT model's implicit reward (beta * log pi/pi_ref with pi = pi_ref) is 0 on every pair: no better
    # than chance. After DPO it ranks the held-out pairs (never trained on) well above chance ...
    assert s["pref_acc"] >= 0.65
    # ... and the model's own likelihood ranking of them is not worse than the SFT model's.
    assert s["likelihood_acc"] >= s["likelihood_acc_sft"] - 0.04
    assert records[0]["step"] == 0 and records[0]["eval_likelihood_acc"] == s["likelihood_acc_sft"]

    before, after = greedy_scores(sft_dir, data), greedy_scores(out, data)
    assert before["format"] >= 0.9 and before["accuracy"] >= 0.25, before  # the SFT model solves the sorting
    assert after["format"] >= before["format"] - 0.1, (before, after)  # DPO keeps the answer form ...
    assert after["accuracy"] >= 0.75 * before["accuracy"], (before, after)  # ... and most of the accuracy


@pytest.fixture(scope="module")
def short_run(sft, tmp_path_factory) -> Path:
    """Three steps, precomputed reference, one process: what the other runs are compared with."""
    data, sft_dir = sft
    out = tmp_path_factory.mktemp("dpo-short") / "dpo"
    run_dpo(dpo_config("dpo-short", **SHORT), data, sft_dir, out)
    return out


def test_online_reference_matches_precomputed(sft, short_run, tmp_path):
    data, sft_dir = sft
    out = tmp_path / "dpo"
    run_dpo(dpo_config("dpo-online", **SHORT, reference="online"), data, sft_dir, out)
    assert step_values(out) == pytest.approx(step_values(short_run), rel=1e-5)
    assert relative_difference(weights(out), weights(short_run)) <= 1e-5
    assert summary(out)["reference"] == "online"


def test_resume_after_kill_is_bitwise(sft, short_run, tmp_path):
    """Killed after step 2 (checkpoint and reference cache on disk), rerun: the same weights as one run."""
    data, sft_dir = sft
    out = tmp_path / "dpo"
    cfg = dpo_config("dpo-short", **SHORT)  # the same key as the uninterrupted run
    killed = run_dpo(cfg, data, sft_dir, out, check=False, **{KILL_AT_STEP_ENV: "2"})
    assert killed.returncode != 0 and not out.exists()
    assert (out.with_name("dpo.resume") / "reference_logps.safetensors").is_file()
    resumed = run_dpo(cfg, data, sft_dir, out)
    assert "resuming from" in resumed.stdout
    assert "reference: training pairs" not in resumed.stderr  # the cached reference log-probs were used
    assert all(torch.equal(a, b) for a, b in zip(weights(out).values(), weights(short_run).values()))
    for key in ("loss", "rewards/margin", "logps/chosen"):
        assert step_values(out, key) == step_values(short_run, key)
    assert not out.with_name("dpo.resume").exists()


def test_on_policy_pairs_file(sft, tmp_path):
    """dpo.pairs: on_policy trains on the pairs file (prompt, chosen, rejected columns) of the reward stage's
    output folder, which the workflow passes."""
    data, sft_dir = sft
    rows = make_splits(DATA["tasks"], {"preference": 16}, seed=7)["preference"]
    reward_dir = tmp_path / "reward"
    reward_dir.mkdir()
    write_pairs([{"prompt": r["prompt"], "chosen": r["response"], "rejected": r["rejected_response"]} for r in rows],
                reward_dir / "pairs.jsonl")
    cfg = dpo_config("dpo-on-policy", **{**SHORT, "steps": 2}, pairs="on_policy")
    missing = run_dpo(cfg, data, sft_dir, tmp_path / "no-pairs", check=False)
    assert missing.returncode == 1 and "pass the reward stage's output folder (or its pairs file) with --pairs" in missing.stderr

    out = tmp_path / "dpo"
    run_dpo(cfg, data, sft_dir, out, extra=("--pairs", str(reward_dir)))
    steps = [r for r in metrics(out) if "loss" in r]
    assert len(steps) == 2 and steps[1]["loss"] != steps[0]["loss"]
    assert summary(out)["pref_pairs"] == 100


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["fsdp2", "tp", "cp"])
def test_two_processes_match_one_process(sft, short_run, tmp_path, layout):
    """FSDP2 over 2 processes, tensor parallelism (loss parallel on vocabulary-sharded logits) over 2, or context
    parallelism (each rank half of every row, the policy's and the reference's sequence log-probs summed over both)."""
    data, sft_dir = sft
    out = tmp_path / "dpo"
    cfg = dpo_config(f"dpo-2proc-{layout}", **SHORT)
    if layout != "fsdp2":
        cfg["parallel"][layout] = 2
    tp = cfg["parallel"]["tp"]
    run_dpo(cfg, data, sft_dir, out, nproc=2)
    losses = step_values(out)
    assert len(losses) == 3 and losses == pytest.approx(step_values(short_run), rel=1e-5)
    # Vocabulary-sharded log-softmax sums in another order than one process: float32 noise of ~1e-5
    # in the weights after 3 steps (1.07e-5 measured with the chosen-NLL term); FSDP2 stays within 1e-5.
    assert relative_difference(weights(out), weights(short_run)) <= (1e-5 if tp == 1 else 3e-5)
    assert summary(out)["pref_acc"] == pytest.approx(summary(short_run)["pref_acc"], abs=0.011)
