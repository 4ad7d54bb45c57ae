"""Reward functions from a file (`rewards/mine.py:fn`, relative to the working directory), called on batches
and weighed: the loader, the dry run's one-line errors, the stage key over the file's code, and GRPO trained
on two batched, weighted functions whose logged values are the functions' own."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest

from grpo_testing import GRPO_SCRIPT, RANDOM_DATA, grpo_config, random_policy, step_records
from sft_testing import ROOT, env_for, write_config
from posttrain.rewards import Batched, Rewards, VerifierError, load_verifier, score
from posttrain.workflow.inputs import code_record
from posttrain.workflow.schema import ConfigError, load_config, validate_config

BASE = load_config(ROOT / "config" / "config.yaml")
BREVITY = {"fn": "rewards/mine.py:brevity", "weight": 2.0, "batched": True}
DIGITS = {"fn": "rewards/mine.py:digits", "weight": -0.5, "batched": True}
# Two batched functions beside a helper module they import; each appends the batch it saw to $REWARD_LOG.
MINE = textwrap.dedent('''
    import json
    import os

    from helpers import SCALE


    def _log(name, completions, values):
        if os.environ.get("REWARD_LOG"):
            with open(os.environ["REWARD_LOG"], "a") as f:
                f.write(json.dumps({"fn": name, "n": len(completions), "values": values}) + "\\n")


    def brevity(completions, examples):
        values = [1.0 / (1.0 + len(c)) for c in completions]
        _log("brevity", completions, values)
        return values


    def digits(completions, examples):
        values = [SCALE * sum(ch.isdigit() for ch in c) for c in completions]
        _log("digits", completions, values)
        return values


    def per_sample(completion, example):
        return float(completion == example["answer"])


    def wrong_length(completions, examples):
        return [1.0]


    def one_arg(completions):
        return [0.0] * len(completions)
''')


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A user's working directory with rewards/mine.py and rewards/helpers.py; not on sys.path."""
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "mine.py").write_text(MINE)
    (tmp_path / "rewards" / "helpers.py").write_text("SCALE = 0.25\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_file_functions_are_called_once_per_batch_and_weighed(workdir, monkeypatch):
    log = workdir / "calls.jsonl"
    monkeypatch.setenv("REWARD_LOG", str(log))
    rewards = Rewards(["task", BREVITY, DIGITS, "rewards/mine.py:per_sample"])
    assert isinstance(rewards.verifiers[BREVITY["fn"]], Batched) and not isinstance(rewards.verifiers["task"], Batched)
    completions = ["#### 12", "#### 7", "the answer is 12"]
    examples = [{"prompt": "p", "answer": "12", "task": "arithmetic", "id": str(i)} for i in range(3)]
    values = rewards.score(completions, examples)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(c["fn"], c["n"]) for c in calls] == [("brevity", 3), ("digits", 3)]  # one call each, on the whole batch
    for row, c in zip(values, completions):
        assert row == {"task": float(c.endswith("12")), BREVITY["fn"]: 1 / (1 + len(c)),
                       DIGITS["fn"]: 0.25 * sum(ch.isdigit() for ch in c), "rewards/mine.py:per_sample": 0.0}
        assert rewards.total(row) == row["task"] + 2.0 * row[BREVITY["fn"]] - 0.5 * row[DIGITS["fn"]] + 0.0
    assert [rewards.correct(v) for v in values] == [True, False, True]  # the first entry, its own value


def test_batched_failures_name_the_function_and_the_batch(workdir):
    rows = [{"prompt": "p", "answer": "1", "task": "", "id": "a"}] * 2
    bad = {"rewards/mine.py:wrong_length": load_verifier({"fn": "rewards/mine.py:wrong_length", "batched": True})}
    with pytest.raises(VerifierError, match=r"'rewards/mine.py:wrong_length' failed on a batch of 2 completions: "
                                            r"returned 1 values for 2 completions"):
        score(["a", "b"], rows, bad)
    with pytest.raises(ImportError, match="no such file .*nope.py"):
        load_verifier("rewards/nope.py:f")
    with pytest.raises(ImportError, match="has no attribute 'missing'"):
        load_verifier("rewards/mine.py:missing")
    with pytest.raises(ValueError, match="built-in verifier scores one completion at a time"):
        load_verifier({"fn": "math", "batched": True})


def test_the_dry_run_checks_file_functions_in_one_line_each(workdir):
    ok = copy.deepcopy(BASE)
    ok["reward"]["verifiers"] = ["task", BREVITY, DIGITS]
    assert validate_config(ok)["reward"]["verifiers"][1] == BREVITY  # no PYTHONPATH needed
    (workdir / "rewards" / "broken.py").write_text("import no_such_dependency\n")
    bad = copy.deepcopy(BASE)
    bad["reward"]["verifiers"] = ["task", {"fn": "rewards/mine.py:one_arg", "batched": True}, "rewards/mine.py:brevity_x",
                                  "rewards/none.py:f", "rewards/broken.py:f", "rewards/mine.py:per_sample",
                                  {"fn": "rewards/mine.py:per_sample", "weight": 2.0}, {"fn": "bad spec"}]
    with pytest.raises(ConfigError) as err:
        validate_config(bad, where="test.yaml")
    text = str(err.value)
    assert 'reward.verifiers[7].fn: "bad spec" does not match the pattern' in text  # the schema first
    bad["reward"]["verifiers"].pop()
    with pytest.raises(ConfigError) as err:
        validate_config(bad, where="test.yaml")
    lines = str(err.value).splitlines()[1:]
    mine = workdir / "rewards" / "mine.py"
    assert lines == [
        "  - reward.verifiers[1]: rewards/mine.py:one_arg: takes (completions); a batched reward function is called as "
        "fn(completions: list[str], examples: list[dict]) -> list[float]",
        f"  - reward.verifiers[2]: rewards/mine.py:brevity_x: {mine} has no 'brevity_x'",
        f"  - reward.verifiers[3]: rewards/none.py:f: no such file {workdir / 'rewards' / 'none.py'} (a reward file's "
        "path is relative to the working directory)",
        f"  - reward.verifiers[4]: rewards/broken.py:f: cannot import {workdir / 'rewards' / 'broken.py'} "
        "(ModuleNotFoundError: No module named 'no_such_dependency')",
        "  - reward.verifiers[6]: rewards/mine.py:per_sample: listed twice (also reward.verifiers[5])",
    ]


def test_the_key_covers_the_files_code_and_the_modules_beside_it(workdir):
    record = code_record("rewards/mine.py", [], workdir)
    assert sorted(record["modules"]) == ["helpers.py", "mine.py"] and record["file"] == "rewards/mine.py"
    (workdir / "rewards" / "mine.py").write_text(MINE + "# a comment\n")
    assert code_record("rewards/mine.py", [], workdir)["code"] == record["code"]
    (workdir / "rewards" / "helpers.py").write_text("SCALE = 0.5\n")
    assert code_record("rewards/mine.py", [], workdir)["code"] != record["code"]


def test_a_dry_run_plans_with_a_reward_file_of_the_working_directory(workdir):
    """`snakemake -n -s <checkout>/Snakefile` from the user's directory: the file is found without PYTHONPATH,
    and GRPO's resolved config keys it by its code and its helper's."""
    (workdir / "overlay.yaml").write_text(f"reward: {{verifiers: [task, {json.dumps(BREVITY)}]}}\nablations: null\n")
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-s", str(ROOT / "Snakefile"), "--configfile",
                           str(ROOT / "config/smoke.yaml"), "overlay.yaml"], cwd=workdir, capture_output=True, text=True,
                          env={k: v for k, v in env_for().items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (config,) = workdir.glob("results/**/grpo/*.config.json")
    files = json.loads(config.read_text())["files"]
    assert sorted(files["reward.verifiers[1]"]["modules"]) == ["helpers.py", "mine.py"]


def test_two_batched_weighted_functions_from_a_file_drive_grpo(workdir, tmp_path):
    """GRPO's logged per-function rewards are the functions' own values on each step's whole batch (one call
    of prompts_per_step x group_size completions each), and its reward is their weighted sum."""
    (tmp_path / "policy").mkdir()
    data, model = random_policy(tmp_path / "policy")
    cfg = grpo_config("batched", data=RANDOM_DATA, reward={"verifiers": [BREVITY, DIGITS]}, steps=3, checkpoint_every=3,
                      prompts_per_step=4, group_size=2, max_new_tokens=8, eval_prompts=2, lr=1e-3)
    config = write_config(cfg, tmp_path / "grpo.json")
    log, out = workdir / "calls.jsonl", tmp_path / "grpo"
    proc = subprocess.run([sys.executable, str(GRPO_SCRIPT), "--config", str(config), "--data", str(data), "--model",
                           str(model), "--out", str(out)], cwd=workdir, capture_output=True, text=True,
                          env=env_for(REWARD_LOG=str(log)), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [c for c in calls if c["n"] == 8]  # the held-out accuracy's calls score 2 prompts each
    assert [c["fn"] for c in steps] == ["brevity", "digits"] * 3 and len(calls) == 6 + 2 * 2
    records = step_records(out)
    assert len(records) == 3
    for record, (brevity, digits) in zip(records, zip(steps[0::2], steps[1::2])):
        mean_b, mean_d = (sum(c["values"]) / 8 for c in (brevity, digits))
        assert record[f"reward/{BREVITY['fn']}"] == pytest.approx(mean_b, abs=1e-12)
        assert record[f"reward/{DIGITS['fn']}"] == pytest.approx(mean_d, abs=1e-12)
        assert record["reward_mean"] == pytest.approx(2.0 * mean_b - 0.5 * mean_d, abs=1e-6)
    assert any(r["reward_std"] > 0 and r["grad_norm"] > 0 for r in records)  # the rewards moved the policy
