"""A researcher's own inputs through the real workflow: a local JSONL data file, a local model folder and a
reward function in their working directory, with a pipeline other than the default (`[sft, grpo]`).

The smoke pipeline runs once, end to end; then each input is edited in place and `snakemake -n` must plan
exactly the stages that read it and everything downstream, under new keys (the old outputs stay), and
say which file changed; a touch that changes no byte, or an edit undone, plans nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from posttrain.model_files import save_hf_model
from posttrain.models import Transformer, preset_config
from posttrain.tokenizer import train_bpe_tokenizer
from snakemake_testing import job_counts

REPO = Path(__file__).resolve().parents[2]
KEY = "[0-9a-f]{12}"
REWARD_CODE = '''"""My verifier: the share of the reference answer's characters the reply holds (partial credit)."""


def overlap(completion, example):
    answer = set(str(example["answer"]).replace(" ", ""))
    return len(answer & set(completion)) / max(1, len(answer))
'''
OVERLAY = """
ablations: null
results: results/mine
pipeline: [sft, grpo]
model: {policy: policy}
data:
  tasks: [{name: sort, length: 3, max_value: 9}]
  sources: [{kind: sft, path: data/sft.jsonl}]
reward: {verifiers: ["my_reward:overlap"]}
grpo: {prompts_per_step: 1}  # the pass-rate band may keep as few prompts as that of the barely trained policy
"""
AFTER_SFT = {"reward": 1, "grpo": 1, "evaluate": 2, "export": 1, "report": 1, "variant": 1, "all": 1}


class UserWorkflow:
    """A working directory of the user's own: their files, the checkout's Snakefile and profiles."""

    def __init__(self, root: Path):
        self.root = root
        (root / "data").mkdir(parents=True)
        rows = [{"prompt": f"sort: {a} {b} {c}", "response": " ".join(sorted(f"{a}{b}{c}"))}
                for a, b, c in zip(range(1, 10), range(9, 0, -1), [5, 3, 7, 1, 8, 2, 9, 4, 6])]
        self.data = root / "data" / "sft.jsonl"
        self.data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        self.policy = root / "policy"
        texts = [r["prompt"] + " " + r["response"] for r in rows] * 20  # byte-level: every other text encodes too
        tok = train_bpe_tokenizer(texts, 320, self.policy, model_max_length=64)
        torch.manual_seed(0)
        hf = preset_config("tiny", tok.vocab_size, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
        save_hf_model(Transformer(hf).state_dict(), hf, self.policy)
        self.reward = root / "my_reward.py"
        self.reward.write_text(REWARD_CODE)
        (root / "mine.yaml").write_text(OVERLAY)
        self.results = root / "results" / "mine"

    def snakemake(self, *args: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--profile", str(REPO / "profiles/local"),
             "--configfile", str(REPO / "config/smoke.yaml"), "mine.yaml", *args],
            cwd=self.root, capture_output=True, text=True, timeout=1200, env={**os.environ, "OMP_NUM_THREADS": "1"})
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output[-5000:]
        return output

    def plan(self) -> tuple[Counter, str]:
        output = self.snakemake("--dry-run", "--quiet", "rules")
        return job_counts(output), output

    def manifest(self) -> dict:
        return json.loads((self.results / "variants" / "default" / "manifest.json").read_text())


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> UserWorkflow:
    wf = UserWorkflow(tmp_path_factory.mktemp("user") / "work")
    wf.snakemake()
    return wf


def moved_keys(output: str, stage: str) -> tuple[str, str]:
    """(new, old) key of `stage` from its rerun reason line."""
    found = re.search(rf"^rerun reason: {stage} ({KEY}) \(was ({KEY})\): (.*)$", output, re.M)
    assert found, output
    return found.group(1), found.group(2)


def assert_new_keys_beside_the_old(wf: UserWorkflow, output: str, stages: dict[str, str]) -> None:
    """Each stage's reason names the changed file; its old output stays, its new key has none yet."""
    for stage, what in stages.items():
        new, old = moved_keys(output, stage)
        folder = {"prepare_data": "data", "evaluate": "eval"}.get(stage, stage)
        assert (wf.results / folder / old).is_dir() and not (wf.results / folder / new).exists()
        assert re.search(rf"^rerun reason: {stage} {new} \(was {old}\): .*{re.escape(what)}", output, re.M), output


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_pipeline_of_sft_then_grpo_runs_on_the_users_files(finished):
    manifest = finished.manifest()
    assert set(manifest["stages"]) == {"prepare_data", "sft", "reward", "grpo"}
    assert set(manifest["eval"]) == {"sft", "grpo"} and manifest["export"]["stage"] == "grpo"
    assert manifest["previous"] == {"sft": None, "grpo": "sft"}
    grpo = json.loads((finished.root / manifest["stages"]["grpo"]["path"] / "posttrain.json").read_text())
    assert grpo["config"]["upstream"]["sft"] == manifest["stages"]["sft"]["key"]
    # The user's files are in the keys' records: the data file and the policy by content, the reward by code.
    data_cfg = json.loads(Path(finished.root / f"{manifest['stages']['prepare_data']['path']}.config.json").read_text())
    assert data_cfg["files"]["data.sources[0].path"]["path"] == str(finished.data.resolve())
    assert set(grpo["config"]["files"]) == {"model.policy", "reward.verifiers[0]"}
    assert list(grpo["config"]["files"]["reward.verifiers[0]"]["modules"]) == ["my_reward.py"]
    # SFT trained on the local rows as well as the task's, and GRPO moved SFT's weights.
    stats = json.loads((finished.root / manifest["stages"]["prepare_data"]["path"] / "stats.json").read_text())
    smoke_rows = yaml.safe_load((REPO / "config/smoke.yaml").read_text())["data"]["n_sft"]
    assert stats["splits"]["sft"]["source_rows"] + stats["splits"]["sft_eval"]["source_rows"] == smoke_rows + 9
    sft = load_file(finished.root / manifest["stages"]["sft"]["path"] / "model.safetensors")
    rl = load_file(finished.root / manifest["stages"]["grpo"]["path"] / "model.safetensors")
    assert any(not torch.equal(sft[k], rl[k]) for k in sft)
    assert finished.plan()[0] == Counter()


@pytest.mark.slow
def test_an_appended_data_row_reruns_data_prep_and_all_after_it(finished):
    before = finished.data.read_bytes()
    try:
        with finished.data.open("a") as f:
            f.write(json.dumps({"prompt": "sort: 3 2 1", "response": "1 2 3"}) + "\n")
        counts, output = finished.plan()
        assert counts == Counter({"prepare_data": 1, "sft": 1, **AFTER_SFT})
        assert_new_keys_beside_the_old(finished, output, {"prepare_data": "file: data.sources[0].path (data/sft.jsonl)",
                                                          "sft": "input: new key of prepare_data"})
    finally:
        finished.data.write_bytes(before)  # the same bytes, a new mtime: the cache rehashes, the key is back
    assert finished.plan()[0] == Counter()


@pytest.mark.slow
def test_a_changed_weight_in_the_policy_folder_reruns_sft_and_all_after_it(finished):
    weights = finished.policy / "model.safetensors"
    backup = finished.root / "model.safetensors.bak"
    shutil.copy2(weights, backup)
    try:
        tensors = load_file(weights)
        name = sorted(tensors)[0]
        tensors[name].view(-1)[0] += 0.25
        save_file(tensors, weights, metadata={"format": "pt"})
        counts, output = finished.plan()
        assert counts == Counter({"sft": 1, **AFTER_SFT})  # data prep reads only the folder's tokenizer
        assert_new_keys_beside_the_old(finished, output, {"sft": "file: model.policy (policy)"})
    finally:
        shutil.copyfile(backup, weights)
    assert finished.plan()[0] == Counter()


@pytest.mark.slow
def test_an_edit_of_the_reward_function_reruns_the_stages_that_score_with_it(finished):
    try:
        finished.reward.write_text(REWARD_CODE + "# a comment changes no code\n")
        assert finished.plan()[0] == Counter()
        finished.reward.write_text(REWARD_CODE.replace("set(completion)", "set(completion.split()[-1:])"))
        counts, output = finished.plan()
        # The reward scoring, GRPO and both evaluations score with it; SFT and data prep do not.
        assert counts == Counter(AFTER_SFT)
        assert_new_keys_beside_the_old(finished, output, {"reward": "file: reward.verifiers[0] (my_reward.py)",
                                                          "grpo": "file: reward.verifiers[0] (my_reward.py)",
                                                          "evaluate": "file: reward.verifiers[0] (my_reward.py)"})
    finally:
        finished.reward.write_text(REWARD_CODE)
    assert finished.plan()[0] == Counter()


@pytest.mark.slow
def test_a_touch_that_changes_no_byte_plans_nothing(finished):
    for path in (finished.data, finished.policy / "model.safetensors", finished.policy / "tokenizer.json",
                 finished.reward):
        os.utime(path, None)
    assert finished.plan()[0] == Counter()
